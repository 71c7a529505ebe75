"""Sphinx configuration: MyST Markdown pages, the API reference from the docstrings (autodoc + autosummary).

``make docs`` builds with warnings as errors (``-W --keep-going``), so a public name without a docstring (the
``autodoc-process-docstring`` hook below), a docstring that is not valid reStructuredText, a broken link between
pages or a page missing from the table of contents fails the build.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

import lightning_mgpu

project = "lightning-mgpu"
author = "lightning-mgpu developers"
copyright = "lightning-mgpu developers"
release = lightning_mgpu.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "_scripts", "_data", "_templates", "_generated", "README.md"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

html_theme = "furo"
html_title = f"lightning-mgpu {release}"

templates_path = ["_templates"]
autosummary_generate = True
autodoc_default_options = {"members": True, "show-inheritance": True, "member-order": "bysource"}
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_inherit_docstrings = False
# Not nitpicky: the docstrings name private helpers and Lightning/torch classes whose docs are not linked (the
# build runs offline); `make docs NITPICKY=1` (sphinx-build -n) lists those references.


# Public names still without a docstring (a data constant needs a ``#:`` comment where it is assigned). The list
# is for the maintainers of ``lightning_mgpu/`` to empty; tests/meta/test_docs.py checks it is exactly the names that
# lack one, so nothing is added to it quietly and a name documented since must leave it.
KNOWN_UNDOCUMENTED: set[str] = set()


def _doc_comment_where_assigned(name: str, obj: object) -> list[str]:
    """The ``#:`` comment of a constant re-exported by ``lightning_mgpu/__init__.py``, read in the module that
    assigns it (autodoc reads only the module the name is documented under)."""
    from sphinx.pycode import ModuleAnalyzer

    short = name.rpartition(".")[2]
    for module_name, module in sorted(sys.modules.items()):
        if not module_name.startswith("lightning_mgpu.") or module_name.startswith("lightning_mgpu.lightning"):
            continue
        if getattr(module, short, None) is not obj:
            continue
        try:
            docs = ModuleAnalyzer.for_module(module_name).find_attr_docs()
        except Exception:  # a module without source
            continue
        if ("", short) in docs:
            return list(docs[("", short)])
    return []


def _warn_on_missing_docstring(app, what, name, obj, options, lines) -> None:
    """Fail the build (``-W``) on a documented public name without a docstring of its own."""
    if not name.startswith("lightning_mgpu.") or any(part.startswith("_") for part in name.split(".")):
        return
    if what == "data" and "\n".join(lines).strip() == (type(obj).__doc__ or "").strip():
        lines.clear()  # autodoc fell back to the type's docstring (dict, tuple): the constant has none of its own
        lines.extend(_doc_comment_where_assigned(name, obj))
    if name in KNOWN_UNDOCUMENTED:
        lines[:] = ["Not documented in the source yet; the guides describe it."]
        return
    kinds = ("module", "class", "function", "exception", "data")
    if what in kinds and name.count(".") == 1 and not any(line.strip() for line in lines):
        from sphinx.util import logging

        logging.getLogger(__name__).warning("%s %s has no docstring", what, name)


def _draw_benchmark_plots(app) -> None:
    """The benchmark page's PNGs, drawn from docs/_data/benchmarks.json by docs/_scripts/plots.py."""
    sys.path.insert(0, os.path.join(app.confdir, "_scripts"))
    import plots

    plots.main()


def setup(app) -> None:
    app.connect("builder-inited", _draw_benchmark_plots)
    app.connect("autodoc-process-docstring", _warn_on_missing_docstring)


autodoc_preserve_defaults = True
