"""The docs site (``docs/``) builds with warnings as errors, every page is reachable from the
index, and no page keeps a diary.

The site is built once per module, into a temporary directory, exactly as the README's command
builds it (``sphinx-build -W --keep-going -b html docs ...``): about 20 s on two CPU cores, most
of it importing optfuse for the API reference.
"""

import html
import json
import pathlib
import pickle
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
PAGE_SUFFIXES = (".md", ".ipynb")

# Words of a measurement diary, which belong to git history, not to pages (issue 32): who
# measured when, on how busy a machine, and what an earlier version of the code did.
DIARY = [
    r"\bthis session\b", r"\blast session\b", r"\bsessions?\b", r"\bone-off\b",
    r"\bload average\b", r"\bat commit\b", r"\bclean-clone\b", r"\b\d+ passed\b",
    r"\b(previous|earlier|older) versions?\b", r"\bas optfuse did before\b",
]


def _pages() -> set[str]:
  """The docnames of every page source under docs/ (build outputs and hidden folders aside)."""
  names = set()
  for path in DOCS.rglob("*"):
    relative = path.relative_to(DOCS)
    if path.suffix in PAGE_SUFFIXES and not any(
        part.startswith(("_", ".")) for part in relative.parts):
      names.add(relative.with_suffix("").as_posix())
  return names


@pytest.fixture(scope="module")
def built(tmp_path_factory):
  out = tmp_path_factory.mktemp("docs")
  result = subprocess.run(
      [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html",
       "-d", str(out / "doctrees"), str(DOCS), str(out / "html")],
      cwd=REPO, capture_output=True, text=True, timeout=300)
  return result, out


def test_the_docs_build_with_warnings_as_errors(built):
  result, _ = built
  # -W: any warning of Sphinx (a broken link or cross-reference, bad markup) fails the build.
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]


def test_every_page_under_docs_is_reachable_from_the_index(built):
  result, out = built
  assert "isn't included in any toctree" not in result.stderr
  with open(out / "doctrees" / "environment.pickle", "rb") as f:
    env = pickle.load(f)
  reached, todo = set(), ["index"]
  while todo:
    name = todo.pop()
    if name not in reached:
      reached.add(name)
      todo.extend(env.toctree_includes.get(name, []))
  assert _pages() <= set(env.found_docs), "a page under docs/ was not read by Sphinx"
  assert _pages() - reached == set()


def _text(page: pathlib.Path) -> str:
  """A built page's text: no scripts, styles or tags."""
  source = re.sub(r"<(script|style)\b.*?</\1>", " ", page.read_text(), flags=re.S)
  return html.unescape(re.sub(r"<[^>]+>", " ", source))


def test_no_page_and_not_the_readme_uses_diary_words(built):
  _, out = built
  texts = {name: _text(out / "html" / f"{name}.html") for name in _pages()}
  texts["README.md"] = (REPO / "README.md").read_text()
  found = {name: sorted({m.group(0) for word in DIARY
                         for m in re.finditer(word, text, re.IGNORECASE)})
           for name, text in texts.items()}
  assert {name: words for name, words in found.items() if words} == {}


def _cells(path: pathlib.Path) -> list[tuple[str, str]]:
  cells = json.loads(path.read_text())["cells"]
  return [(cell["cell_type"], "".join(cell["source"])) for cell in cells]


def test_the_rendered_notebook_is_the_examples_notebook_with_its_outputs():
  # The docs render docs/quickstart.ipynb from its stored outputs (nb_execution_mode "off");
  # examples/quickstart.ipynb is kept without outputs (tests/project/test_notebook.py). After
  # editing the example, store its outputs again: python docs/store_quickstart.py.
  rendered = DOCS / "quickstart.ipynb"
  assert _cells(rendered) == _cells(REPO / "examples" / "quickstart.ipynb")
  code = [cell for cell in json.loads(rendered.read_text())["cells"]
          if cell["cell_type"] == "code"]
  assert all(cell["execution_count"] is not None and cell["outputs"] for cell in code)
