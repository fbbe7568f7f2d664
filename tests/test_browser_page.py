"""A real browser: headless Chromium (Debian's `chromium`, driven by npm `puppeteer-core`) loads a dapp
page from another origin (the test's own server, `localhost`; the proxy is on `127.0.0.1`). The page
uses viem, served as ES modules with an import map, to read a contract and a balance over HTTP and
watch blocks over WebSocket: through the proxy it sees what it sees against Anvil; a key whose
allowed_origins list names another origin is refused."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.support import DEV_ACCOUNT, ROOT, Anvil, ProxyFactory, fake_server
from tests.test_read_your_writes import node_binary

TOOLS = ROOT / ".tools"
MODULES = TOOLS / "node_modules"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CONDITIONS = ("browser", "import", "module", "default")

pytestmark = pytest.mark.skipif(
    CHROMIUM is None or not (MODULES / "puppeteer-core").is_dir(),
    reason="needs Debian's chromium and npm puppeteer-core: bash scripts/test.sh installs both",
)


def _target(entry: Any) -> str | None:
    """The file an `exports` entry names for a browser's ES module import (Node's conditions)."""
    if isinstance(entry, str):
        return entry
    if isinstance(entry, dict):
        for condition in CONDITIONS:
            if condition in entry:
                found = _target(entry[condition])
                if found is not None:
                    return found
    return None


def _package_imports(package: Path) -> dict[str, str]:
    """Specifier -> URL for one package's exports (its `module`/`main` without them)."""
    meta = json.loads((package / "package.json").read_text())
    name, url = meta["name"], "/nm/" + package.relative_to(MODULES).as_posix()
    exports = meta.get("exports")
    if not isinstance(exports, dict) or not any(k.startswith(".") for k in exports):
        exports = {".": exports or meta.get("module") or meta.get("main") or "index.js"}
    imports = {}
    for subpath, entry in exports.items():
        target = _target(entry)
        if target is not None and "*" not in subpath and target.endswith((".js", ".mjs")):
            imports[name + subpath[1:]] = f"{url}/{target.removeprefix('./')}"
    return imports


def import_map() -> dict[str, Any]:
    """An import map for every package under .tools/node_modules; a nested node_modules (a package's
    own copy of a dependency) becomes a scope of the package that holds it."""
    imports: dict[str, str] = {}
    scopes: dict[str, dict[str, str]] = {}
    for manifest in sorted(MODULES.rglob("package.json")):
        package = manifest.parent
        parts = package.relative_to(MODULES).parts
        if "node_modules" not in parts[:-1] and len(parts) > (2 if parts[0].startswith("@") else 1):
            continue  # a package.json inside a package (dist/, esm/): not a package root
        try:
            found = _package_imports(package)
        except (ValueError, KeyError, TypeError):
            continue
        if "node_modules" in parts:
            holder = "/nm/" + "/".join(parts[: len(parts) - parts[::-1].index("node_modules") - 1]) + "/"
            scopes.setdefault(holder, {}).update(found)
        else:
            imports.update(found)
    return {"imports": imports, "scopes": scopes}


async def _page_server() -> TestServer:
    page = (ROOT / "tests/browser/page.html").read_text().replace("__IMPORT_MAP__", json.dumps(import_map()))

    async def index(request: web.Request) -> web.Response:
        return web.Response(text=page, content_type="text/html")

    app = web.Application()
    app.router.add_get("/page.html", index)
    app.router.add_static("/nm/", MODULES, follow_symlinks=True)
    server = await fake_server(app)
    return server


async def _drive(urls: list[str], anvil: Anvil, home: Path) -> list[dict[str, Any]]:
    """Open each page in Chromium; meanwhile mine a block every half second for the block watchers."""
    process = await asyncio.create_subprocess_exec(
        node_binary(),
        str(ROOT / "tests/browser/drive.mjs"),
        str(CHROMIUM),
        *urls,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={"TOOLS": str(TOOLS), "HOME": str(home)},  # HOME: where Chromium keeps its profile
    )
    communicating = asyncio.ensure_future(process.communicate())
    try:
        while not communicating.done():
            await asyncio.to_thread(anvil.mine)
            await asyncio.wait({communicating}, timeout=0.5)
        out, err = communicating.result()
    finally:
        if process.returncode is None:
            process.kill()
    assert process.returncode == 0, err.decode()[-2000:]
    return [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]


async def test_a_dapp_page_on_another_origin_reads_and_subscribes_through_the_proxy_as_against_anvil(
    anvil: Anvil,
    tmp_path: Path,
    make_proxy: ProxyFactory,
) -> None:
    store = anvil.deploy_store()
    keys = tmp_path / "keys.toml"
    keys.write_text(
        '[keys.dapp]\nkey = "dapp-key"\n[keys.locked]\nkey = "locked-key"\nallowed_origins = ["https://app.example"]\n'
    )
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, API_KEYS_FILE=str(keys), HEAD_POLL_INTERVAL="0.5")
    pages = await _page_server()
    try:
        page = f"http://localhost:{pages.port}/page.html?"  # localhost: another origin than the proxy's 127.0.0.1
        common = {"store": store, "account": DEV_ACCOUNT}
        ws_anvil = anvil.url.replace("http", "ws")
        urls = [
            page + urlencode({**common, "http": anvil.url, "ws": ws_anvil}),
            page + urlencode({**common, "http": proxy.url("dapp-key"), "ws": proxy.ws_url("dapp-key")}),
            page + urlencode({**common, "http": proxy.url("locked-key"), "ws": proxy.ws_url("locked-key")}),
        ]
        direct, through, locked = await _drive(urls, anvil, tmp_path)
        assert "error" not in direct, direct
        assert "error" not in through, through
        assert (through["balance"], through["x"]) == (direct["balance"], direct["x"]) == (through["balance"], "7")
        for seen in (direct, through):  # a block pushed over the WebSocket, as the node has it
            block = anvil.rpc("eth_getBlockByNumber", hex(seen["block"]), False)
            assert block["hash"] == seen["hash"]
        assert "allowed_origins" in locked["error"], locked
    finally:
        await pages.close()
