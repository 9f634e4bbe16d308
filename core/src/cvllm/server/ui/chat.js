// The page's side of the API: where it is (/ui-config.json), the served models, and a streamed chat completion
// read event by event from the fetch body. Aborting the fetch closes the connection, and the server then
// aborts the request in the engine.
"use strict";

(function () {
  class ApiError extends Error {
    constructor(status, message) {
      super(message);
      this.name = "ApiError";
      this.status = status;
    }
  }

  async function errorOf(response) {
    let message = `${response.status} ${response.statusText}`;
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) message = body.error.message;
    } catch (_) { /* not JSON: the status line says enough */ }
    return new ApiError(response.status, message);
  }

  class Api {
    // base: "" for this page's own origin, else the API's origin (the page on its own port, --ui-server)
    constructor(base, key) {
      this.base = base || "";
      this.key = key || "";
    }

    headers(json) {
      const headers = {};
      if (json) headers["Content-Type"] = "application/json";
      if (this.key) headers.Authorization = `Bearer ${this.key}`;
      return headers;
    }

    async models() {
      const response = await fetch(`${this.base}/v1/models`, { headers: this.headers(false) });
      if (!response.ok) throw await errorOf(response);
      return (await response.json()).data.map((card) => card.id);
    }

    // Yields the chunks of a streamed chat completion until [DONE]; an error event is thrown as an ApiError.
    async *stream(body, signal) {
      const response = await fetch(`${this.base}/v1/chat/completions`, {
        method: "POST", headers: this.headers(true), body: JSON.stringify(body), signal,
      });
      if (!response.ok) throw await errorOf(response);
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      try {
        for (;;) {
          const { value, done } = await reader.read();
          if (done) return;
          buffer += decoder.decode(value, { stream: true });
          let cut;
          while ((cut = buffer.indexOf("\n\n")) >= 0) {
            const event = buffer.slice(0, cut);
            buffer = buffer.slice(cut + 2);
            for (const line of event.split("\n")) {
              if (!line.startsWith("data:")) continue;
              const data = line.slice(5).trim();
              if (data === "[DONE]") return;
              const chunk = JSON.parse(data);
              if (chunk.error) throw new ApiError(chunk.error.code || 500, chunk.error.message);
              yield chunk;
            }
          }
        }
      } finally {
        reader.releaseLock();
      }
    }
  }

  async function loadConfig() {
    try {
      const response = await fetch("/ui-config.json", { cache: "no-store" });
      if (response.ok) return await response.json();
    } catch (_) { /* opened some other way: assume the API is here */ }
    return { api_base: "", api_key_required: false };
  }

  // tokens per second of a reply: decode speed over the time from its first token to its last
  function speed(tokens, started, first, last) {
    if (!tokens) return 0;
    if (tokens > 1 && first !== null && last > first) return (tokens - 1) / ((last - first) / 1000);
    return tokens / (Math.max(1, last - started) / 1000);
  }

  // the line under a reply: "12 tokens · 31.4 tok/s · stopped" ("~" where no usage came: counted chunks)
  function statsText(stats) {
    if (!stats) return "";
    const parts = [`${stats.approximate ? "~" : ""}${stats.tokens} tokens`];
    if (stats.tokens) parts.push(`${stats.tokensPerSecond.toFixed(1)} tok/s`);
    if (stats.stopped) parts.push("stopped");
    else if (stats.finish === "length") parts.push("cut at max tokens");
    return parts.join(" \u00b7 ");
  }

  window.cvllmChat = { Api, ApiError, loadConfig, speed, statsText };
})();
