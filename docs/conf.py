"""Sphinx configuration of the cuflash documentation.

Build with::

    python -m sphinx -W --keep-going -b html docs docs/_build/html

The visible-key pictures are drawn at every build by ``make_mask_figures.py``
from the library's own masking rule, into ``docs/_static/masks/``; the table of
kernels is written from ``cuflash.gpu.registry`` into ``docs/_generated/``.
"""

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))  # document the checkout, installed or not
sys.path.insert(0, str(DOCS))

import kernel_table  # noqa: E402
import make_mask_figures  # noqa: E402

import cuflash  # noqa: E402

make_mask_figures.main(DOCS / "_static" / "masks")
# The kernel registry's coverage table, for the performance page.
(DOCS / "_generated").mkdir(exist_ok=True)
(DOCS / "_generated" / "kernels.md").write_text(kernel_table.coverage_table() + "\n")

project = "cuflash"
author = "the cuflash authors"
copyright = "the cuflash authors"
release = cuflash.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.mathjax",
    "numpydoc",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "README.md", "results", "_generated"]
templates_path = []

# MyST: $...$ math, ::: fences for admonitions, anchors for ## and ### headings.
myst_enable_extensions = ["dollarmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

# autodoc + numpydoc: signatures as written, no type hints (there are none),
# members listed explicitly in api.rst.
autodoc_member_order = "bysource"
autodoc_typehints = "none"
autodoc_preserve_defaults = True
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False

pygments_style = "sphinx"
nitpicky = True  # every cross-reference must resolve (with -W, a broken one fails the build)

html_theme = "pydata_sphinx_theme"
html_title = f"cuflash {release}"
html_static_path = ["_static"]
html_show_sourcelink = False
html_theme_options = {
    "navbar_align": "left",
    "show_toc_level": 2,
    "navigation_with_keys": False,
    "secondary_sidebar_items": ["page-toc"],
    "footer_start": ["copyright"],
    "footer_end": ["sphinx-version"],
}
html_sidebars = {"**": []}  # a flat site: the top bar is the navigation
html_context = {"default_mode": "auto"}
