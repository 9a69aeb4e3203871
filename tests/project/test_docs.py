"""The doc pages hold together: every relative link resolves, and the quick start is what the tests and CI run."""
from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

from support.helpers import DEMO_CFG, DOC_PAGES, ROOT

# [text](target) and ![alt](target); the target ends at the first space (a title may follow) or ")".
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)[^)]*\)")


def _without_fences(text: str) -> str:
    """``text`` without its fenced blocks, whose ``#`` lines are comments, not headings."""
    return re.sub(r"(?ms)^\s*```.*?^\s*```[^\n]*$", "", text)


def _prose(text: str) -> str:
    """``text`` without fenced blocks and inline code, where brackets are code, not links."""
    return re.sub(r"`[^`\n]*`", "", _without_fences(text))


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives ``page``'s headings: lower case, punctuation dropped, spaces as hyphens."""
    slugs: set[str] = set()
    for heading in re.findall(r"(?m)^#{1,6} +(.+?) *$", _without_fences(page.read_text(encoding="utf-8"))):
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").lower()).replace(" ", "-")
        n = 0
        while (candidate := slug if n == 0 else f"{slug}-{n}") in slugs:
            n += 1
        slugs.add(candidate)
    return slugs


def broken_links(page: Path) -> list[str]:
    """The relative links of ``page`` whose file, or whose anchor in a Markdown file, does not exist."""
    broken = []
    for target in _LINK.findall(_prose(page.read_text(encoding="utf-8"))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not this repository's
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {os.path.relpath(file, ROOT)}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading with anchor #{anchor} in {os.path.relpath(file, ROOT)}")
    return broken


def test_every_relative_link_of_the_readme_and_docs_resolves():
    assert DOC_PAGES[0].name == "README.md" and len(DOC_PAGES) > 10  # README and every page under docs/
    broken = {os.path.relpath(page, ROOT): broken_links(page) for page in DOC_PAGES}
    assert {page: links for page, links in broken.items() if links} == {}


def test_the_link_checker_sees_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## What a run writes (under `CKPT`)\n\n"
                                       "```bash\n# no heading\n```\n")
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](other.md#what-a-run-writes-under-ckpt) [ok](#title) ![ok](other.md)\n"
                    "[gone](missing.md) [bad](other.md#no-heading) [bad](#nowhere) [web](https://example.com/x.md)\n"
                    "`[code](not-a-link.md)`\n")
    assert broken_links(page) == ["missing.md: no file " + os.path.relpath(tmp_path / "missing.md", ROOT),
                                  "other.md#no-heading: no heading with anchor #no-heading in "
                                  + os.path.relpath(tmp_path / "other.md", ROOT),
                                  "#nowhere: no heading with anchor #nowhere in " + os.path.relpath(page, ROOT)]


def test_every_config_the_docs_name_exists():
    named = {(os.path.relpath(page, ROOT), path) for page in DOC_PAGES
             for path in re.findall(r"cfgs/[\w./-]+\.yaml", page.read_text(encoding="utf-8"))}
    assert len(named) > 10
    assert sorted(item for item in named if not os.path.isfile(os.path.join(ROOT, item[1]))) == []


def _quick_start_commands() -> list[str]:
    readme = DOC_PAGES[0].read_text(encoding="utf-8")
    quick_start = readme.split("\n## Quick start\n")[1].split("\n## ")[0]
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", quick_start, flags=re.S)]


def test_the_quick_start_is_two_one_line_commands():
    commands = _quick_start_commands()
    assert len(commands) == 2 and all("\n" not in c for c in commands), commands


def test_the_first_command_trains_and_tests_the_demo_config_the_tests_run():
    words = shlex.split(_quick_start_commands()[0])
    steps = [step.split() for step in " ".join(words).split(" && ")]
    assert steps[0] == ["pip", "install", "-e", "."]
    assert [step[:2] for step in steps[1:]] == [["python", "tools/train_net.py"], ["python", "tools/test_net.py"]]
    configs = {step[step.index("--cfg") + 1] for step in steps[1:]}
    assert configs == {os.path.relpath(DEMO_CFG, ROOT)}, configs  # train and test the config tests/ trains
    assert os.path.isfile(DEMO_CFG)


def test_ci_runs_the_second_command_literally():
    ci = [line.strip() for line in Path(ROOT, ".ci", "run").read_text(encoding="utf-8").splitlines()]
    assert _quick_start_commands()[1] in ci
