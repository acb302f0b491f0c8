"""What every path shares: the dtypes, the validation of a call (``problem``) and the
masking rule."""
