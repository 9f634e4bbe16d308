// The chat page: conversations kept in this browser's localStorage, replies streamed in and rendered as markdown,
// a thinking model's reasoning in a collapsible block, a stop button, sampling settings and the API key.
"use strict";

(function () {
  const { Api, ApiError, loadConfig, speed, statsText } = window.cvllmChat;
  const { render, escapeHtml } = window.cvllmMarkdown;
  const $ = (id) => document.getElementById(id);
  const KEYS = { conversations: "cvllm.conversations", current: "cvllm.current", settings: "cvllm.settings",
                 apiKey: "cvllm.apiKey" };
  const SETTINGS = { system: "system-prompt", temperature: "temperature", top_p: "top-p", max_tokens: "max-tokens" };
  const NEW_TITLE = "New chat";

  function load(key, fallback) {
    try { return JSON.parse(localStorage.getItem(key)) ?? fallback; } catch (_) { return fallback; }
  }
  const save = (key, value) => localStorage.setItem(key, JSON.stringify(value));

  let conversations = load(KEYS.conversations, []);
  let currentId = load(KEYS.current, null);
  let settings = load(KEYS.settings, {});
  let api = null;
  let controller = null;   // the AbortController of the reply streaming now
  let live = null;         // that reply and its view: { reply, view }

  const current = () => conversations.find((c) => c.id === currentId);
  const persist = () => { save(KEYS.conversations, conversations); save(KEYS.current, currentId); };

  function newConversation() {
    const conversation = { id: `${Date.now().toString(36)}${Math.random().toString(36).slice(2, 7)}`,
                           title: NEW_TITLE, messages: [] };
    conversations.unshift(conversation);
    currentId = conversation.id;
    persist();
    return conversation;
  }

  // -- the sidebar -------------------------------------------------------------------------------------------------
  function renderSidebar() {
    const list = $("conversations");
    list.replaceChildren();
    for (const conversation of conversations) {
      const item = document.createElement("li");
      item.className = conversation.id === currentId ? "conversation active" : "conversation";
      const open = document.createElement("button");
      open.type = "button";
      open.className = "open";
      open.textContent = conversation.title;
      open.title = conversation.title;
      open.addEventListener("click", () => { currentId = conversation.id; persist(); renderAll(); });
      const remove = document.createElement("button");
      remove.type = "button";
      remove.className = "delete";
      remove.textContent = "\u00d7";
      remove.title = "Delete this conversation";
      remove.addEventListener("click", () => deleteConversation(conversation.id));
      item.append(open, remove);
      list.append(item);
    }
  }

  function deleteConversation(id) {
    const doomed = conversations.find((c) => c.id === id);
    if (live && doomed && doomed.messages.includes(live.reply)) stop();
    conversations = conversations.filter((c) => c.id !== id);
    if (currentId === id) currentId = conversations.length ? conversations[0].id : null;
    persist();
    renderAll();
  }

  // -- messages ----------------------------------------------------------------------------------------------------
  function messageView(message, streaming) {
    const element = document.createElement("div");
    element.className = `message ${message.role}`;
    if (message.role === "user") {
      const text = document.createElement("div");
      text.className = "content";
      text.textContent = message.content;
      element.append(text);
      return { element, update() {} };
    }
    const thinking = document.createElement("details");
    thinking.className = "thinking";
    thinking.open = Boolean(streaming);
    const summary = document.createElement("summary");
    const reasoning = document.createElement("div");
    reasoning.className = "reasoning";
    thinking.append(summary, reasoning);
    const content = document.createElement("div");
    content.className = "content";
    const footer = document.createElement("div");
    footer.className = "stats";
    element.append(thinking, content, footer);
    function update(done) {
      thinking.hidden = !message.reasoning;
      summary.textContent = done ? "Thinking" : "Thinking\u2026";
      if (message.reasoning) reasoning.innerHTML = render(message.reasoning);
      let html = render(message.content);
      if (message.error) html += `<p class="error">${escapeHtml(message.error)}</p>`;
      content.innerHTML = html;
      element.classList.toggle("streaming", !done);
      footer.textContent = statsText(message.stats);
    }
    update(!streaming);
    return { element, update };
  }

  function renderMessages() {
    const box = $("messages");
    box.replaceChildren();
    const conversation = current();
    if (!conversation || !conversation.messages.length) {
      const empty = document.createElement("p");
      empty.className = "empty";
      empty.textContent = "Send a message to start.";
      box.append(empty);
      return;
    }
    for (const message of conversation.messages) {
      box.append(live && live.reply === message ? live.view.element : messageView(message, false).element);
    }
    box.scrollTop = box.scrollHeight;
  }

  function renderAll() {
    renderSidebar();
    renderMessages();
  }

  // -- sending -----------------------------------------------------------------------------------------------------
  function requestBody(conversation) {
    const messages = [];
    if (settings.system) messages.push({ role: "system", content: settings.system });
    for (const m of conversation.messages) {
      if (m.role === "assistant" && !m.content) continue;   // an error, or a reply stopped before its first word
      messages.push({ role: m.role, content: m.content });
    }
    const body = { messages, stream: true, stream_options: { include_usage: true } };
    if ($("model").value) body.model = $("model").value;
    for (const name of ["temperature", "top_p", "max_tokens"]) {
      const value = settings[name];
      if (value !== undefined && value !== "") body[name] = Number(value);
    }
    return body;
  }

  function setBusy(busy) {
    $("send").disabled = busy;
    $("stop").disabled = !busy;
    document.body.classList.toggle("busy", busy);
  }

  async function send(text) {
    if (controller || !text.trim()) return;
    const conversation = current() || newConversation();
    conversation.messages.push({ role: "user", content: text });
    if (conversation.title === NEW_TITLE) conversation.title = text.trim().slice(0, 48);
    const body = requestBody(conversation);
    const reply = { role: "assistant", content: "", reasoning: "" };
    conversation.messages.push(reply);
    const view = messageView(reply, true);
    live = { reply, view };
    persist();
    renderAll();
    controller = new AbortController();
    setBusy(true);
    const started = performance.now();
    let first = null, last = started, chunks = 0, usage = null, finish = null, pending = false, saved = started;
    const refresh = () => {
      if (pending) return;
      pending = true;
      requestAnimationFrame(() => {
        pending = false;
        view.update(false);
        const box = $("messages");
        if (box.contains(view.element)) box.scrollTop = box.scrollHeight;
        if (performance.now() - saved > 1000) { saved = performance.now(); persist(); }   // a reload keeps it
      });
    };
    try {
      for await (const chunk of api.stream(body, controller.signal)) {
        if (chunk.usage) usage = chunk.usage;
        const choice = chunk.choices && chunk.choices[0];
        if (!choice) continue;
        const delta = choice.delta || {};
        if (delta.reasoning_content) reply.reasoning += delta.reasoning_content;
        if (delta.content) reply.content += delta.content;
        if (delta.content || delta.reasoning_content) {
          chunks += 1;
          last = performance.now();
          if (first === null) first = last;
          refresh();
        }
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    } catch (error) {
      if (error.name === "AbortError") {
        reply.stopped = true;
      } else if (error instanceof ApiError && error.status === 401) {
        conversation.messages.splice(-2, 2);   // not sent: back to the composer once there is a key
        $("prompt").value = text;
        askForKey("The server needs an API key to answer.");
      } else {
        reply.error = error instanceof ApiError ? error.message : `Cannot reach the server: ${error.message}`;
      }
    } finally {
      controller = null;
      live = null;
      setBusy(false);
      const tokens = usage ? usage.completion_tokens : chunks;
      if (conversation.messages.includes(reply) && (tokens || reply.stopped)) {
        reply.stats = { tokens, approximate: !usage, stopped: Boolean(reply.stopped), finish,
                        tokensPerSecond: speed(tokens, started, first, last) };
      }
      persist();
      if (currentId === conversation.id) renderAll();
    }
  }

  function stop() {
    if (controller) controller.abort();
  }

  // -- settings, models and the API key ----------------------------------------------------------------------------
  function bindSettings() {
    for (const [name, id] of Object.entries(SETTINGS)) {
      const input = $(id);
      input.value = settings[name] ?? "";
      input.addEventListener("input", () => { settings[name] = input.value; save(KEYS.settings, settings); });
    }
  }

  async function loadModels() {
    const select = $("model");
    try {
      const names = await api.models();
      select.replaceChildren(...names.map((name) => new Option(name, name)));
      $("status").textContent = "";
    } catch (error) {
      if (error instanceof ApiError && error.status === 401) askForKey("The server needs an API key.");
      else $("status").textContent = `Cannot list the models: ${error.message}`;
    }
  }

  function askForKey(reason) {
    $("key-reason").textContent = reason;
    $("key-input").value = api.key;
    if (!$("key-dialog").open) $("key-dialog").showModal();
    $("key-input").focus();
  }

  function bindKeyDialog() {
    $("key-form").addEventListener("submit", (event) => {
      event.preventDefault();
      api.key = $("key-input").value.trim();
      save(KEYS.apiKey, api.key);
      $("key-dialog").close();
      loadModels();
    });
    $("key-cancel").addEventListener("click", () => $("key-dialog").close());
    $("set-key").addEventListener("click", () => askForKey("The key is kept in this browser only."));
  }

  async function start() {
    const config = await loadConfig();
    api = new Api(config.api_base, load(KEYS.apiKey, ""));
    bindSettings();
    bindKeyDialog();
    $("composer").addEventListener("submit", (event) => {
      event.preventDefault();
      const text = $("prompt").value;
      if (!text.trim() || controller) return;
      $("prompt").value = "";
      send(text);
    });
    $("prompt").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        $("composer").requestSubmit();
      }
    });
    $("stop").addEventListener("click", stop);
    $("new-chat").addEventListener("click", () => { if (!current() || current().messages.length) newConversation();
                                                    renderAll(); $("prompt").focus(); });
    if (currentId !== null && !current()) currentId = conversations.length ? conversations[0].id : null;
    renderAll();
    if (config.api_key_required && !api.key) askForKey("This server needs an API key.");
    else await loadModels();
    document.body.dataset.ready = "true";
  }

  start();
})();
