"""The docs site: the settings reference is what the settings table makes, and README stays a front page."""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

from proxy.config import OPTIONS, ConfigError, build_settings
from tests.support import ROOT

SETTINGS_PAGE = ROOT / "docs/configuration/settings.md"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("settings_reference", ROOT / "scripts/settings_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_settings_reference_is_what_the_settings_table_makes() -> None:
    assert SETTINGS_PAGE.read_text() == _generator().render(), "run: python scripts/settings_reference.py"


def test_the_settings_reference_lists_every_env_name_and_flag_once() -> None:
    rows = [line for line in SETTINGS_PAGE.read_text().splitlines() if line.startswith("| `")]
    assert len(rows) == len(OPTIONS)
    for option, row in zip(OPTIONS, rows, strict=True):
        assert row.startswith(f"| `{option.env}` | `{option.flag}` |"), row


def test_the_readme_is_a_front_page_that_links_only_to_pages_that_exist() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert "bash scripts/test.sh" in readme and "EVM_UPSTREAM_WS" in readme
    for target in re.findall(r"\]\(((?:docs/|CHANGELOG)[^)#]*)", readme):
        assert (ROOT / target).is_file(), target


def test_every_docs_page_is_in_the_site_navigation() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in (ROOT / "docs").rglob("*.md"):
        assert str(page.relative_to(ROOT / "docs")) in nav, page


def _toml_blocks() -> list[tuple[str, str]]:
    """(where, text) of every ```toml block of README.md and docs/, and of each commented-out TOML
    example inside one (`# upstreams = [` ... up to its closing bracket)."""
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = page.read_text()
        for block in re.finditer(r"```toml\n(.*?)```", text, re.S):
            where = f"{page.relative_to(ROOT)}:{text[: block.start()].count(chr(10)) + 1}"
            found.append((where, block.group(1)))
            lines = block.group(1).splitlines()
            for start, line in enumerate(lines):
                if not re.match(r"\s*# [a-z_]+ = ", line):
                    continue
                run, depth = [], 0
                for part in lines[start:]:
                    run.append(part.split("#", 1)[1][1:])
                    depth += sum(part.count(c) for c in "[{") - sum(part.count(c) for c in "]}")
                    if depth <= 0:
                        break
                found.append((f"{where} (commented: {line.strip()[:30]})", "\n".join(run)))
    return found


def test_every_toml_example_in_the_docs_parses_and_a_whole_networks_file_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rule: a TOML example is valid TOML 1.0 (an inline table on one line), and one that is a whole
    NETWORKS_FILE is one the proxy loads."""
    blocks = _toml_blocks()
    assert len(blocks) > 5 and any("commented" in where for where, _ in blocks)
    loaded = 0
    for where, text in blocks:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise AssertionError(f"{where}: not valid TOML: {exc}") from None
        if set(data) != {"networks"}:
            continue
        for name in re.findall(r"\$\{([A-Z_]+)\}", text):
            monkeypatch.setenv(name, "x")
        path = tmp_path / "networks.toml"
        path.write_text(text)
        try:
            build_settings({"NETWORKS_FILE": str(path)})
        except ConfigError as exc:
            raise AssertionError(f"{where}: the proxy refuses it: {exc}") from None
        loaded += 1
    assert loaded >= 3


def test_every_section_env_example_cites_exists() -> None:
    """Rule: `README "Section"`, `docs/page.md` and `docs/page.md "Section"` in .env.example resolve."""
    text = (ROOT / ".env.example").read_text()
    cited = re.findall(r'(README|docs/[\w/-]+\.md)(?: "([^"]+)")?', text)
    assert cited
    for page, section in cited:
        path = ROOT / ("README.md" if page == "README" else page)
        assert path.exists(), f".env.example cites {page}, which does not exist"
        headings = re.findall(r"^#+ (.+)$", path.read_text(), re.M)
        assert not section or section in headings, f'.env.example cites {page} "{section}", no heading of it'
