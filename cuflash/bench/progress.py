"""Progress on stderr: a bar over the cases (tqdm, or one line without it), status lines."""

import sys


class TextProgress:
    """A one-line progress report on stderr, used when tqdm is not installed."""

    def __init__(self, total, desc):
        self.total, self.desc, self.done, self.postfix = total, desc, 0, ""

    def _show(self):
        print(
            f"\r{self.desc}: {self.done}/{self.total} {self.postfix}",
            end="",
            file=sys.stderr,
            flush=True,
        )

    def set_postfix_str(self, text):
        self.postfix = text
        self._show()

    def update(self, count=1):
        self.done += count
        self._show()

    def close(self):
        print(file=sys.stderr)


def progress_bar(total, desc):
    """A tqdm bar on stderr, or :class:`TextProgress` without tqdm."""
    try:
        from tqdm import tqdm
    except ImportError:
        return TextProgress(total, desc)
    return tqdm(total=total, desc=desc, file=sys.stderr, unit="case")


def print_status(text):
    """A status line on stderr."""
    print(f"cuflash.bench: {text}", file=sys.stderr, flush=True)
