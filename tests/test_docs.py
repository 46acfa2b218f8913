"""The README is the short way in: its commands, its figure and its links agree with the docs site."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def test_the_readme_stays_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move the detail into a page under docs/"
    prose = re.sub(r"```.*?```", "", "\n".join(lines), flags=re.DOTALL)  # code blocks are not sentences
    prose = re.sub(r"\n(\s*)- ", r"\n\n\1- ", prose)  # nor is a list one paragraph
    paragraphs = [" ".join(p.split()) for p in prose.split("\n\n") if not p.lstrip().startswith(("#", "|"))]
    long = [s for p in paragraphs for s in re.split(r"(?<=[.!?:])\s+(?=[A-Z*`\[])", p) if len(s.split()) > 60]
    assert not long, f"sentences over 60 words: {long}"


def test_readme_quickstart_has_the_two_make_commands_ci_uses():
    text = README.read_text()
    assert "make demo" in text and "make test" in text
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_the_readme_demo_line_is_the_one_the_demo_page_records():
    """One `make demo` figure, with its provenance on docs/demo.md; the README quotes it as printed."""
    line = re.findall(r"^done: .*$", README.read_text(), re.MULTILINE)
    assert len(line) == 1 and line[0] in (DOCS / "demo.md").read_text()


def test_the_demo_pass_rule_is_the_demo_pages_and_every_figure_quoted_meets_it():
    """The README states the demo's range and pass rule as docs/demo.md measures them: the rule is
    the page's word for word, the range is the page's table's, and every run quoted passes."""
    readme, page = README.read_text(), (DOCS / "demo.md").read_text()
    rule = re.findall(r"^\*\*Pass rule:\*\* .*$", readme, re.MULTILINE)
    assert len(rule) == 1 and rule[0] in page.splitlines()
    floor, slack = map(float, re.search(r"eval/accuracy ends at ([\d.]+) or above, and replay/ratio is within "
                                        r"([\d.]+) of its target", rule[0]).groups())
    runs = [tuple(map(float, pair)) for row in re.findall(r"^\| \d+ \|.*\|$", page, re.MULTILINE)
            for pair in re.findall(r"([\d.]+) -> ([\d.]+)", row)]
    assert len(runs) >= 6  # at least 3 seeds on 2 instruction sets
    starts, ends = [s for s, _ in runs], [e for _, e in runs]
    stated = re.search(r"ended at ([\d.]+)-([\d.]+) from ([\d.]+)-([\d.]+)", " ".join(readme.split()))
    assert tuple(map(float, stated.groups())) == tuple(round(x, 2) for x in (min(ends), max(ends), min(starts),
                                                                             max(starts)))
    assert min(ends) >= floor
    for line in re.findall(r"^done: .*$", readme + page, re.MULTILINE):
        end, ratio, target = map(float, re.search(r"eval/accuracy [\d.]+ -> ([\d.]+) \| replay/ratio ([\d.]+) "
                                                  r"\(target ([\d.]+)\)", line).groups())
        assert end >= floor and abs(ratio - target) <= slack, line


def test_the_readme_links_only_pages_that_exist():
    links = re.findall(r"\]\((docs/[^)#]+)(?:#[^)]*)?\)", README.read_text())
    assert links
    for link in links:
        assert (ROOT / link).is_file(), link


def test_the_tensorboard_viewer_the_docs_name_has_an_extra():
    """Runs write TensorBoard files without it (tensorboardX), but `tensorboard --logdir`
    needs the viewer, which no default install brings."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(req.startswith("tensorboard>=") for req in extras.get("tensorboard", []))
    text = (DOCS / "demo.md").read_text()
    assert "tensorboard --logdir" in text and "pip install -e '.[tensorboard]'" in text


def test_the_docs_extra_is_in_the_test_extra_so_make_installs_it():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = lambda reqs: {re.split(r"[<>=;\s]", r)[0] for r in reqs}
    assert names(extras["docs"]) == {"mkdocs", "mkdocs-material"} and names(extras["docs"]) <= names(extras["test"])
