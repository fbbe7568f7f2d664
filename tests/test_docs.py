"""The docs site: the settings reference is what the settings table makes, and README stays a front page."""

from __future__ import annotations

import importlib.util
import re
from types import ModuleType

from proxy.config import OPTIONS
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
