"""Sphinx configuration of the optfuse docs: MyST pages, myst-nb notebooks, autodoc API.

Build: ``sphinx-build -W --keep-going -b html docs docs/_build/html``. Nothing is fetched: the
build runs offline (no intersphinx), and notebooks render from their stored outputs.
"""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
# autodoc imports optfuse from this checkout, whatever else is installed.
sys.path.insert(0, str(ROOT))

project = "optfuse"
author = "optfuse authors"
copyright = "optfuse authors"
release = "0.1.0"

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]

source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "**.ipynb_checkpoints"]
root_doc = "index"

# Notebooks render from the outputs stored in them: docs/quickstart.ipynb is
# examples/quickstart.ipynb with its outputs (python docs/store_quickstart.py stores them).
nb_execution_mode = "off"
# Its stderr holds the runtime's logs (JAX probing for a GPU or TPU, progress bars), not results.
nb_output_stderr = "remove"
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

# Every cross-reference must resolve.
nitpicky = True

# The docstrings state each argument's type in words; the annotations name other projects'
# types (jax, optax, flax, typing), which an offline build (no intersphinx) cannot link to.
autodoc_typehints = "none"
autodoc_member_order = "bysource"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# Attributes as fields of the class, not as separate entries that would clash with autodoc's.
napoleon_use_ivar = True
napoleon_attr_annotations = False

html_theme = "sphinx_book_theme"
html_title = "optfuse"
html_theme_options = {"show_toc_level": 2}
