"""The chat page cvserve serves: its routes, files and flags in process, a live --ui-server, and a live server
driven by a real headless browser (skipped, saying why, where no chromium is installed)."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest
from starlette.applications import Starlette

from cvllm.server.app import build_app
from cvllm.server.cli import CliError, build_server_args, main
from cvllm.server.ui import ASSETS, UI_DIR, build_ui_app, ui_origins
from cvllm.testing import CHATML_TEMPLATE
from cvllm.testing.fakes import FakeClient, make_state
from cvllm.testing.server import LiveServer, free_port
from cvllm.testing.web_ui import fake_model_dir, headless_chromium, metric, save_artifact, until

KEY = "page-key"
# ChatML whose generation prompt opens a thinking block: every token of the fake model is then reasoning_content
THINK_TEMPLATE = CHATML_TEMPLATE.replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n'")


def request(app: Starlette, method: str, path: str, base: str = "http://127.0.0.1:2000", **kwargs) -> httpx.Response:
    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=base) as client:
            return await client.request(method, path, **kwargs)
    return asyncio.run(run())


def app_with(tokenizer, **args) -> Starlette:
    state = make_state(tokenizer, FakeClient([[300, 301, 302]]))
    for name, value in args.items():
        setattr(state.args, name, value)
    return build_app(state)


def test_every_asset_ships_and_is_small():
    names = {path.name for path in UI_DIR.iterdir() if path.is_file()}
    assert names == set(ASSETS)
    assert sum((UI_DIR / name).stat().st_size for name in names) < 64 << 10
    page = (UI_DIR / "index.html").read_text()
    for name in ASSETS:
        assert name == "index.html" or f"/ui/{name}" in page
    # offline: nothing is loaded from another host
    for name in ASSETS:
        text = (UI_DIR / name).read_text()
        assert "//cdn" not in text and "<script src=\"http" not in text and "@import" not in text


def test_page_and_assets_at_the_api_port(tokenizer):
    app = app_with(tokenizer)
    page = request(app, "GET", "/")
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    assert "<title>cvllm chat</title>" in page.text
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "connect-src 'self';" in csp
    assert page.headers["x-content-type-options"] == "nosniff"
    for name, kind in ASSETS.items():
        response = request(app, "GET", f"/ui/{name}")
        assert response.status_code == (404 if name == "index.html" else 200), name
        if name != "index.html":
            assert response.headers["content-type"] == kind and response.content == (UI_DIR / name).read_bytes()
    assert request(app, "GET", "/ui/../app.py").status_code == 404
    assert request(app, "GET", "/ui/nope.js").status_code == 404
    assert request(app, "GET", "/ui-config.json").json() == {"api_base": "", "api_key_required": False}
    assert request(app, "HEAD", "/").status_code == 200
    assert request(app, "GET", "/v1/models").json()["data"][0]["id"] == "fake"


def test_no_ui_leaves_no_page(tokenizer):
    app = app_with(tokenizer, ui=False)
    for path in ("/", "/ui/app.js", "/ui-config.json"):
        response = request(app, "GET", path)
        assert response.status_code == 404 and response.json()["error"]["message"] == f"No route GET {path}."


def test_page_needs_no_key_but_the_api_does(tokenizer):
    app = app_with(tokenizer, api_key=KEY)
    assert request(app, "GET", "/").status_code == 200
    assert request(app, "GET", "/ui/app.js").status_code == 200
    assert request(app, "GET", "/ui-config.json").json() == {"api_base": "", "api_key_required": True}
    assert request(app, "GET", "/v1/models").status_code == 401
    assert request(app, "GET", "/ui/secret").status_code == 404   # open, but only the page's files are there
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    assert request(app, "POST", "/v1/chat/completions", json=chat).status_code == 401
    authorized = request(app, "POST", "/v1/chat/completions", json=chat, headers={"Authorization": f"Bearer {KEY}"})
    assert authorized.status_code == 200
    # without the page its paths are no longer open: the key check answers first, as for any unknown route
    assert request(app_with(tokenizer, api_key=KEY, ui=False), "GET", "/").status_code == 401


def test_ui_server_app_points_the_page_at_the_api(tokenizer):
    ui = build_ui_app(api_port=8000, api_key_required=True)
    config = request(ui, "GET", "/ui-config.json", base="http://box.lan:8001").json()
    assert config == {"api_base": "http://box.lan:8000", "api_key_required": True}
    page = request(ui, "GET", "/", base="http://box.lan:8001")
    assert "connect-src 'self' http://box.lan:8000;" in page.headers["content-security-policy"]
    assert request(ui, "GET", "/ui/style.css").headers["content-type"] == "text/css; charset=utf-8"
    missing = request(ui, "GET", "/v1/models")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    ipv6 = request(ui, "GET", "/ui-config.json", base="http://[::1]:8001").json()
    assert ipv6["api_base"] == "http://[::1]:8000"


def test_api_allows_the_page_origin_through_cors(tokenizer):
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    app = app_with(tokenizer, api_key=KEY, ui_port=2001)
    assert request(app, "GET", "/").status_code == 401   # the page is on its own port, not here
    for origin, allowed in (("http://127.0.0.1:2001", True), ("http://localhost:2001", True),
                            ("http://127.0.0.1:2002", False), ("http://evil.example:2001", False)):
        response = request(app, "OPTIONS", "/v1/chat/completions", headers={"Origin": origin, **preflight})
        assert (response.headers.get("access-control-allow-origin") == origin) == allowed, origin
    denied = request(app, "GET", "/v1/models", headers={"Origin": "http://localhost:2001"})
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == "http://localhost:2001"
    everywhere = app_with(tokenizer, host="0.0.0.0", ui_port=2001, cors_allow_origins=["http://app.example"])
    for origin, allowed in (("http://box.lan:2001", True), ("http://app.example", True), ("http://box.lan:2", False)):
        response = request(everywhere, "OPTIONS", "/v1/models", headers={"Origin": origin, **preflight})
        assert (response.headers.get("access-control-allow-origin") == origin) == allowed, origin


def test_ui_origins():
    assert ui_origins("0.0.0.0", 9) == ([], r"https?://[^/]+:9")
    assert "http://[::1]:9" in ui_origins("127.0.0.1", 9)[0]
    assert ui_origins("10.1.2.3", 9) == (["http://10.1.2.3:9", "https://10.1.2.3:9"], None)
    assert ui_origins("fd00::1", 9)[0][0] == "http://[fd00::1]:9"


def test_flags(model_dir):
    def ui(*flags: str) -> tuple[bool, int | None]:
        args = build_server_args(["--w", str(model_dir), *flags])
        return args.ui, args.ui_port

    assert ui() == (True, None)
    assert ui("--no-ui") == (False, None)
    assert ui("--ui-server") == (True, 2001)
    assert ui("--p", "8000", "--ui-server") == (True, 8001)
    assert ui("--ui-port", "3000") == (True, 3000)
    assert ui("--ui-server", "--ui-port", "3000") == (True, 3000)
    assert ui("--p", "0", "--ui-server") == (True, 0)
    for flags, message in ((["--no-ui", "--ui-server"], "give one of them"), (["--ui-port", "2000"], "API's port"),
                           (["--p", "65535", "--ui-server"], "give --ui-port")):
        with pytest.raises(CliError, match=message):
            ui(*flags)


def test_ui_port_in_use_is_a_start_error(model_dir, capsys):
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        taken = other.getsockname()[1]
        assert main(["--w", str(model_dir), "--p", str(free_port()), "--ui-port", str(taken)]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"cvserve: error: cannot serve on 127.0.0.1:{taken}: address already in use")


@pytest.fixture(scope="module")
def live_ui_server(tmp_path_factory):
    """cvserve --ui-server --api-key: the page on a port of its own, the API on the other; a thinking template."""
    assert THINK_TEMPLATE != CHATML_TEMPLATE
    engine = {"model": str(fake_model_dir(tmp_path_factory.mktemp("ui-server"))), "backend": "cpu",
              "fake_step_ms": 5, "num_kv_blocks": 256}
    with LiveServer(engine, ui_port=free_port(), api_key=KEY, served_model_names=["tiny-chat"],
                    chat_template=THINK_TEMPLATE) as server:
        server.ui_url = f"http://127.0.0.1:{server.spec['ui_port']}"
        yield server


def test_live_ui_server_serves_the_page_on_its_own_port(live_ui_server):
    server, ui_url = live_ui_server, live_ui_server.ui_url
    page = httpx.get(ui_url + "/")
    assert page.status_code == 200 and "/ui/app.js" in page.text
    assert httpx.get(ui_url + "/ui-config.json").json() == {"api_base": server.url, "api_key_required": True}
    assert httpx.get(ui_url + "/v1/models").status_code == 404
    assert httpx.get(server.url + "/").status_code == 401   # the API's port has no page (and wants the key)
    models = httpx.get(server.url + "/v1/models", headers={"Origin": ui_url, "Authorization": f"Bearer {KEY}"})
    assert models.headers["access-control-allow-origin"] == ui_url
    assert json.loads(models.text)["data"][0]["id"] == "tiny-chat"
    assert f"chat page on {ui_url}/" in server.log()


# -- in a real browser --------------------------------------------------------------------------------------------

MARKDOWN_DEMO = {
    "id": "demo", "title": "Markdown demo", "messages": [
        {"role": "user", "content": "Show me <b>markup</b>"},
        {"role": "assistant", "reasoning": "The user wants **markdown**.",
         "content": "# Title\n\nSome **bold**, *italic* and `code`; a [link](https://example.com).\n\n"
                    "- one\n- two\n  1. nested\n\n```python\ndef f(x):\n    return x + 1  # one more\n```\n\n"
                    "<img src=x onerror=\"window.injected=1\"> [bad](javascript:alert(1))",
         "stats": {"tokens": 42, "tokensPerSecond": 12.5, "finish": "stop"}}]}


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """cvserve with an API key, serving the page at /, on a model whose every step takes 40 ms (fake steps over
    the real tokenizer, scheduler, detokenizer and HTTP stack): slow enough to stop a reply mid-stream."""
    engine = {"model": str(fake_model_dir(tmp_path_factory.mktemp("web-ui"))), "backend": "cpu",
              "fake_step_ms": 40, "num_kv_blocks": 1024, "max_num_seqs": 4}
    with LiveServer(engine, api_key=KEY, served_model_names=["tiny-chat"]) as server:
        yield server


@pytest.fixture(scope="module")
def browser():
    driver = headless_chromium()
    yield driver
    driver.quit()


def test_chat_in_a_browser(browser, live, tmp_path):
    """Load the page, give it the key, send, watch the reply stream in, stop it (the server aborts the request),
    send again to the end (tokens/s shown), reload: the conversations are still there, markdown rendered."""
    driver, js = browser, browser.execute_script
    driver.get(live.url + "/")
    until(lambda: js("return document.getElementById('key-dialog').open"), "the API-key dialog")
    driver.find_element("id", "key-input").send_keys(KEY + "\n")
    until(lambda: js("return document.getElementById('model').value") == "tiny-chat", "the model list")

    driver.find_element("id", "prompt").send_keys("Hello there\n")   # Enter sends
    streaming = "return (document.querySelector('.message.assistant.streaming .content') || {}).textContent"
    until(lambda: len(js(streaming) or "") >= 20, "streamed text")
    assert metric(live.url, "cvllm:num_requests_in_flight") == 1
    assert driver.find_element("id", "send").get_attribute("disabled")
    driver.save_screenshot(str(tmp_path / "web_ui_streaming.png"))
    driver.find_element("id", "stop").click()
    until(lambda: not js("return document.querySelector('.streaming')"), "the reply to stop")
    reply = js("return document.querySelector('.message.assistant .content').textContent")
    assert len(reply) >= 20
    assert "stopped" in js("return document.querySelector('.message.assistant .stats').textContent")
    until(lambda: metric(live.url, "cvllm:request_success_total", finished_reason="abort") >= 1,
          "the server to count the request aborted", timeout=5)
    until(lambda: metric(live.url, "cvllm:num_requests_in_flight") == 0, "the server to drop the request")

    max_tokens = driver.find_element("id", "max-tokens")
    js("document.getElementById('settings').open = true")
    max_tokens.send_keys("5")
    driver.find_element("id", "prompt").send_keys("Second question")
    driver.find_element("id", "send").click()
    last_stats = "return [...document.querySelectorAll('.message.assistant .stats')].pop().textContent"
    until(lambda: "tok/s" in js(last_stats) and not js("return document.querySelector('.streaming')"),
          "the second reply")
    assert js(last_stats).startswith("5 tokens") and "cut at max tokens" in js(last_stats)

    js("const all = JSON.parse(localStorage.getItem('cvllm.conversations'));"
       "all.push(arguments[0]); localStorage.setItem('cvllm.conversations', JSON.stringify(all));"
       "localStorage.setItem('cvllm.current', JSON.stringify('demo'));", MARKDOWN_DEMO)
    driver.refresh()
    until(lambda: js("return document.body.dataset.ready"), "the page to load again")
    titles = js("return [...document.querySelectorAll('.conversation .open')].map(b => b.textContent)")
    assert titles == ["Hello there", "Markdown demo"]
    assert js("return document.querySelector('.content h1').textContent") == "Title"
    assert js("return document.querySelectorAll('pre code .tok-kw').length") >= 2
    assert js("return document.querySelector('pre code .tok-com').textContent") == "# one more"
    assert js("return document.querySelector('.content ol li').textContent") == "nested"
    assert js("return document.querySelector('details.thinking strong').textContent") == "markdown"
    assert js("return document.querySelectorAll('#messages img, #messages b').length") == 0
    assert js("return window.injected") is None
    links = js("return [...document.querySelectorAll('.content a')].map(a => a.href)")
    assert links == ["https://example.com/"]
    driver.save_screenshot(str(tmp_path / "web_ui_markdown.png"))

    driver.find_elements("css selector", ".conversation .open")[0].click()
    texts = js("return [...document.querySelectorAll('.message .content')].map(e => e.textContent)")
    assert texts[0] == "Hello there" and texts[1] == reply and texts[2] == "Second question"
    assert len(texts) == 4
    screenshot = tmp_path / "web_ui.png"
    assert driver.save_screenshot(str(screenshot)) and screenshot.stat().st_size > 10_000
    for name in ("web_ui.png", "web_ui_streaming.png", "web_ui_markdown.png"):
        save_artifact(tmp_path / name)
    errors = [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"
              and "401" not in entry["message"]]
    assert not errors, errors


def test_page_on_its_own_port_in_a_browser(browser, live_ui_server):
    """--ui-server: the page, loaded from its own port, reaches the API on the other through CORS (the preflight
    of a POST with an Authorization header) and streams a reply, here all reasoning: shown in the thinking block."""
    driver, js = browser, browser.execute_script
    driver.get(live_ui_server.ui_url + "/")
    until(lambda: js("return document.getElementById('key-dialog').open"), "the API-key dialog")
    driver.find_element("id", "key-input").send_keys(KEY + "\n")
    until(lambda: js("return document.getElementById('model').value") == "tiny-chat", "the model list")
    js("document.getElementById('settings').open = true")
    driver.find_element("id", "max-tokens").send_keys("7")
    driver.find_element("id", "prompt").send_keys("Across origins\n")
    stats = "return (document.querySelector('.message.assistant .stats') || {}).textContent"
    until(lambda: "tok/s" in (js(stats) or ""), "the reply")
    assert js(stats).startswith("7 tokens")
    assert js("return document.querySelector('.message.assistant .reasoning').textContent")
    assert js("return document.querySelector('.message.assistant details.thinking').hidden") is False
    assert js("return document.querySelector('.message.assistant .content').textContent") == ""


MARKDOWN_CASES = {
    "a <script>alert(1)</script> & b": "<p>a &lt;script&gt;alert(1)&lt;/script&gt; &amp; b</p>",
    "**b**, *i*, __u__, ~~s~~ and `x<y`": "<p><strong>b</strong>, <em>i</em>, <strong>u</strong>, <del>s</del> and "
                                         "<code>x&lt;y</code></p>",
    "snake_case_word and 2*3*4": "<p>snake_case_word and 2*3*4</p>",
    "## Heading ##": "<h2>Heading</h2>",
    "line one\nline two\n\nnext": "<p>line one<br>line two</p>\n<p>next</p>",
    "```js\nconst s = \"a\"; // c\n```": '<pre><code class="lang-js"><span class="tok-kw">const</span> s = '
                                       '<span class="tok-str">&quot;a&quot;</span>; <span class="tok-com">// c</span>'
                                       "</code></pre>",
    "```py\nx = 1  # still streaming": '<pre><code class="lang-py">x = <span class="tok-num">1</span>  '
                                      '<span class="tok-com"># still streaming</span></code></pre>',
    "[x](javascript:alert(1))": "<p>[x](javascript:alert(1))</p>",
    '[x](https://a.b/?q="><img>)': '<p><a href="https://a.b/?q=&quot;&gt;&lt;img&gt;" target="_blank" '
                                  'rel="noopener noreferrer">x</a></p>',
    "see https://example.com/a?b=1&c=2.": '<p>see <a href="https://example.com/a?b=1&amp;c=2" target="_blank" '
                                          'rel="noopener noreferrer">https://example.com/a?b=1&amp;c=2</a>.</p>',
    "1. a\n2. b\n\n- c\n  - d": "<ol><li>a</li><li>b</li></ol>\n<ul><li><p>c</p>\n<ul><li>d</li></ul></li></ul>",
    "3) three": '<ol start="3"><li>three</li></ol>',
    "> quoted **text**": "<blockquote><p>quoted <strong>text</strong></p></blockquote>",
    "---": "<hr>",
    "`<b>` in code": "<p><code>&lt;b&gt;</code> in code</p>",
}


def test_markdown_renderer(browser, live):
    browser.get(live.url + "/")
    rendered = browser.execute_script("return arguments[0].map(text => window.cvllmMarkdown.render(text))",
                                      list(MARKDOWN_CASES))
    assert dict(zip(MARKDOWN_CASES, rendered)) == MARKDOWN_CASES
