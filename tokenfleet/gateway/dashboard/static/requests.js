// The requests tab: a request looked up by id, then followed live until its terminal event.
"use strict";

function setRequestState(name) {
  $("#request-state").textContent = name;
  $("#request-state").className = "state-" + name;
}

function showEnd(end) {
  // the terminal event: how it ended, its timings (ms since it was enqueued) and its worker
  setRequestState(end.type === "done" ? "done" : "failed");
  if (end.worker) $("#request-worker").textContent = end.worker;
  const timings = Object.entries(end.timings || {}).map(([k, v]) => `${k.replace(/_ms$/, "")} ${Math.round(v)} ms`);
  $("#request-timings").textContent = timings.join(" · ");
  $("#request-end").textContent = describeEnd(end);
}

function showRequest(r) {
  $("#request").hidden = false;
  setRequestState(r.state);
  $("#request-worker").textContent = r.worker || "-";
  $("#request-where").textContent = r.stream ? "stream " + r.stream : "";
  $("#request-timings").textContent = "";
  $("#request-end").textContent = "";
  $("#request-text").textContent = r.events.filter((e) => e.type === "token").map((e) => e.text).join("");
  if (r.result) showEnd(r.result);
}

function describeEnd(end) {
  if (end.type === "error") return `error ${end.code}: ${end.message}`;
  const usage = end.usage ? ` · ${end.usage.prompt_tokens} prompt + ${end.usage.completion_tokens} completion tokens` : "";
  return `finished: ${end.finish_reason}${usage} · batch ${end.batch_size}`;
}

async function lookUp(id) {
  if (state.following) state.following.abort();
  $("#request-error").textContent = "";
  try {
    const r = await api("/requests/" + encodeURIComponent(id));
    showRequest(r);
    if (r.state === "queued" || r.state === "running") follow(id, r.last_id);
  } catch (e) {
    $("#request").hidden = true;
    $("#request-error").textContent = e.message;
  }
}

async function follow(id, after) {
  // the reply's events as they are written (a streamed fetch: it carries the key, EventSource cannot)
  const control = new AbortController();
  state.following = control;
  const fleet = state.fleet ? "&fleet=" + encodeURIComponent(state.fleet) : "";
  const url = `/dashboard/api/requests/${encodeURIComponent(id)}/follow?after=${encodeURIComponent(after)}${fleet}`;
  try {
    const response = await fetch(url, { headers: headers(), signal: control.signal });
    if (!response.ok) {
      const body = await response.json().catch(() => ({}));
      throw new Error((body.error && body.error.message) || response.statusText);
    }
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffered = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffered += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffered.indexOf("\n")) >= 0) {
        const event = JSON.parse(buffered.slice(0, cut));
        buffered = buffered.slice(cut + 1);
        if (event.type === "token") {
          setRequestState("running");
          $("#request-text").textContent += event.text;
        } else if (event.type === "done" || event.type === "error") {
          showEnd(event);
        } else if (event.type === "interrupted") {
          $("#request-error").textContent = "following stopped (" + event.message + "): look it up again";
        }
      }
    }
  } catch (e) {
    if (e.name !== "AbortError") $("#request-error").textContent = "following stopped: " + e.message;
  }
}
