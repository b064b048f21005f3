// The relay console: plain JavaScript over the admin API (/api), refreshed
// every 3 seconds. The token stays in this tab's sessionStorage.
"use strict";

const $ = (sel) => document.querySelector(sel);
const state = { token: sessionStorage.getItem("relay-token") || "" };

async function api(path, options = {}) {
  const res = await fetch(path, {
    ...options,
    headers: { "Authorization": "Bearer " + state.token, "Content-Type": "application/json", ...(options.headers || {}) },
  });
  const body = await res.json().catch(() => ({}));
  if (!res.ok) throw new Error(body.error || `${res.status} ${res.statusText}`);
  return body;
}

function showError(e) {
  const el = $("#error");
  if (e) { el.textContent = String(e.message || e); el.hidden = false; } else { el.hidden = true; }
}

function text(s) { return s === null || s === undefined ? "–" : String(s); }

function fill(dl, pairs) {
  dl.replaceChildren(...pairs.flatMap(([k, v]) => {
    const dt = document.createElement("dt"); dt.textContent = k;
    const dd = document.createElement("dd"); dd.textContent = text(v); dd.dataset.key = k;
    return [dt, dd];
  }));
}

function count(list, label) { const row = list.find(([l]) => l === label); return row ? row[1] : 0; }

function button(label, onClick, cls) {
  const b = document.createElement("button"); b.type = "button"; b.textContent = label;
  if (cls) b.className = cls;
  b.addEventListener("click", onClick);
  return b;
}

function cell(value, cls) {
  const td = document.createElement("td"); td.textContent = text(value);
  if (cls) td.className = cls;
  return td;
}

async function refresh() {
  if (!state.token) return;
  try {
    // History figures of big tables are estimates (the API names them): "≈".
    const { stats, pauses, estimated = [] } = await api("/api/counts");
    const est = (key, v) => (estimated.includes(key) ? "≈ " + v : v);
    fill($("#intent-counts"), [
      ["pending", count(stats.intents, "pending")], ["running", count(stats.intents, "running")],
      ["succeeded", est("intents.succeeded", count(stats.intents, "succeeded"))], ["dead", count(stats.intents, "dead")],
      ["uncertain", count(stats.intents, "uncertain")],
      ["oldest unfinished (s)", stats.oldest_pending_intent_secs === null ? "–" : stats.oldest_pending_intent_secs.toFixed(1)],
    ]);
    fill($("#outbox-counts"), [
      ["pending", count(stats.outbox, "pending")], ["running", count(stats.outbox, "running")],
      ["published", est("outbox.published", count(stats.outbox, "published"))], ["dead", count(stats.outbox, "dead")],
      ["skipped", count(stats.outbox, "skipped")],
      ["oldest unpublished (s)", stats.oldest_unpublished_outbox_secs === null ? "–" : stats.oldest_unpublished_outbox_secs.toFixed(1)],
    ]);
    fill($("#inbox-counts"), stats.inbox_estimated !== null ? [["all", est("inbox", stats.inbox_estimated)]]
      : stats.inbox.length ? stats.inbox.map(([k, v]) => [k, v]) : [["(empty)", ""]]);
    fill($("#dl-counts"), [["unresolved", stats.dead_letters_unresolved], ["all", stats.dead_letters_total],
      ["held keys", stats.held_keys], ["records held", stats.records_held]]);
    renderPauses(pauses);
    await Promise.all([renderDeadIntents(), renderDeadOutbox(), renderDeadLetters()]);
    $("#updated").textContent = "updated " + new Date().toLocaleTimeString();
    showError(null);
  } catch (e) {
    showError(e);
  }
}

function renderPauses(pauses) {
  $("#no-pauses").hidden = pauses.length > 0;
  $("#pauses").replaceChildren(...pauses.map((p) => {
    const li = document.createElement("li");
    li.textContent = `${p.kind} ${p.name}${p.reason ? " — " + p.reason : ""} (since ${new Date(p.paused_at).toLocaleString()}) `;
    li.append(button("Resume", async () => {
      await api(`/api/pauses/${p.kind}/${encodeURIComponent(p.name)}`, { method: "DELETE" }).catch(showError);
      refresh();
    }));
    return li;
  }));
}

// An action's refusal stays until the next action: the 3-s refresh clears
// only the connection error.
async function act(path, options) {
  try {
    const r = await api(path, options);
    $("#action-error").hidden = true;
    return r;
  } catch (e) {
    $("#action-error").textContent = String(e.message || e);
    $("#action-error").hidden = false;
    return null;
  }
}

async function renderDeadIntents() {
  const [dead, uncertain] = await Promise.all([
    api("/api/intents?state=dead&limit=200"), api("/api/intents?state=uncertain&limit=200"),
  ]);
  const items = dead.items.concat(uncertain.items);
  $("#dead-intent-count").textContent = items.length;
  $("#dead-intents tbody").replaceChildren(...items.map((i) => {
    const tr = document.createElement("tr"); tr.dataset.id = i.id;
    const id = cell(i.id.slice(0, 8) + "…"); id.title = i.id;
    const actions = document.createElement("td");
    if (i.state === "uncertain") {
      // Only once someone asked the provider how the call ended.
      const resolve = (how, effects) => button(`Resolve ${how}`, async () => {
        const note = prompt(`Resolve intent ${i.id} as ${how}: its ${effects} effects are recorded.\nWhat did the provider say? (kept with the intent)`);
        if (note === null) return;
        await act(`/api/intents/${i.id}/resolve`, { method: "POST", body: JSON.stringify({ resolution: how, note: note || null }) });
        refresh();
      }, "resolve");
      actions.append(resolve("succeeded", "on_success"), resolve("failed", "on_dead"));
    }
    if (i.state === "dead" && i.holds_key) {
      // Its route holds the key: the later intents of the key wait for this one.
      actions.append(button("Skip", async () => {
        if (!confirm(`Let intent ${i.id} release its ordering key ${i.ordering_key}?\nIt stays dead; the later intents of the key go on without it.`)) return;
        await act(`/api/intents/${i.id}/skip`, { method: "POST" });
        refresh();
      }, "skip"));
    }
    actions.append(
      button("Attempts", () => showTimeline(i.id)),
      button("Replay", async () => {
        if (!confirm(`Replay intent ${i.id}?\nIt is sent again with the same idempotency key ${i.idempotency_key}.`)) return;
        await act(`/api/intents/${i.id}/replay`, { method: "POST" });
        refresh();
      }, "replay"),
    );
    const state = i.state === "dead" && i.holds_key ? `dead, holds key ${i.ordering_key}` : i.state;
    tr.append(id, cell(state), cell(i.endpoint), cell(i.idempotency_key), cell(`${i.attempts}/${i.max_attempts}`),
      cell(i.last_status), cell(i.last_error, "error-text"), actions);
    return tr;
  }));
}

async function renderDeadOutbox() {
  const { items } = await api("/api/outbox?state=dead&limit=200");
  $("#dead-outbox-count").textContent = items.length;
  $("#dead-outbox tbody").replaceChildren(...items.map((o) => {
    const tr = document.createElement("tr"); tr.dataset.id = o.id;
    const id = cell(o.id.slice(0, 8) + "…"); id.title = o.id;
    const actions = document.createElement("td");
    actions.append(
      button("Replay", async () => {
        if (!confirm(`Publish outbox row ${o.id} again (same id)?\nIt goes out before the ${o.waiting_behind} later row(s) of its key.`)) return;
        await act(`/api/outbox/${o.id}/replay`, { method: "POST" });
        refresh();
      }, "replay"),
      button("Skip", async () => {
        if (!confirm(`Never publish outbox row ${o.id}?\nThe ${o.waiting_behind} later row(s) of its key go on without it.`)) return;
        await act(`/api/outbox/${o.id}/skip`, { method: "POST" });
        refresh();
      }, "skip"),
    );
    tr.append(id, cell(o.topic), cell(o.event_type), cell(o.ordering_key), cell(o.waiting_behind),
      cell(o.last_error, "error-text"), actions);
    return tr;
  }));
}

async function showTimeline(id) {
  const { attempts, reconciliations } = await api(`/api/intents/${id}`);
  $("#timeline-id").textContent = id;
  const item = (when, className, what, status, worker, error) => {
    const li = document.createElement("li");
    li.className = className;
    li.textContent = `${what}${status ? " HTTP " + status : ""} at ${new Date(when).toLocaleTimeString()} by ${worker}${error ? " — " + error : ""}`;
    return [new Date(when), li];
  };
  const calls = attempts.map((a) => item(a.started_at || a.claimed_at, "outcome-" + a.outcome,
    `#${a.attempt} ${a.outcome}`, a.status, a.worker, a.error));
  // Questions to the provider about an unknown outcome, in time order with the calls.
  const asked = (reconciliations || []).map((r) => item(r.started_at || r.finished_at, "reconciled-" + r.verdict,
    `reconciliation #${r.n} ${r.verdict}`, r.status, r.worker, r.error));
  const events = [...calls, ...asked].sort((x, y) => x[0] - y[0]);
  $("#timeline-list").replaceChildren(...events.map(([, li]) => li));
  $("#timeline").hidden = false;
}

async function renderDeadLetters() {
  const { items, total } = await api("/api/dead-letters?limit=200");
  $("#dead-letter-count").textContent = total;
  $("#dead-letters tbody").replaceChildren(...items.map((d) => {
    const tr = document.createElement("tr"); tr.dataset.id = d.id;
    const actions = document.createElement("td");
    // Held behind the head of its key: it goes when the head is replayed or skipped.
    const heldBehind = d.held_behind !== null;
    if (!heldBehind) {
      actions.append(button("Replay", async () => {
        if (!confirm(`Replay dead letter ${d.id} (event ${text(d.event_id)}) through the guards?`)) return;
        const r = await api(`/api/dead-letters/${d.id}/replay`, { method: "POST" }).catch(showError);
        if (r && !r.resolved) showError(`dead letter ${d.id}: ${r.outcome} ${r.detail}`);
        else if (r && r.released) showError(`dead letter ${d.id}: ${r.released.detail}`);
        refresh();
      }, "replay"));
    }
    if (d.holds_key) {
      actions.append(button("Skip", async () => {
        if (!confirm(`Skip dead letter ${d.id}? It is never applied; the records of its key held behind it are applied in order.`)) return;
        await act(`/api/dead-letters/${d.id}/skip`, { method: "POST" });
        refresh();
      }, "skip"));
    }
    if (d.hold_id === null) {
      actions.append(button("Purge", async () => {
        if (!confirm(`Delete dead letter ${d.id} for good?`)) return;
        await api(`/api/dead-letters/${d.id}`, { method: "DELETE" }).catch(showError);
        refresh();
      }, "purge"));
    }
    // Replayed or skipped, but the release of its key was cut short (a crash).
    const cutShort = d.holds_key && d.replay_state !== "open";
    const cls = cutShort ? `${d.error_class}, holds its key: release cut short, replay or skip it again`
      : d.holds_key ? `${d.error_class}, holds its key`
      : heldBehind ? `${d.error_class}, behind dead letter ${d.held_behind}` : d.error_class;
    tr.append(cell(d.id), cell(new Date(d.created_at).toLocaleString()), cell(`${d.topic}[${d.partition}]@${d.offset}`),
      cell(cls), cell(d.event_id), cell(d.reason, "error-text"), actions);
    return tr;
  }));
}

$("#login").addEventListener("submit", (e) => {
  e.preventDefault();
  state.token = $("#token").value.trim();
  sessionStorage.setItem("relay-token", state.token);
  refresh();
});
$("#timeline-close").addEventListener("click", () => { $("#timeline").hidden = true; });
if (state.token) $("#token").value = state.token;
refresh();
setInterval(refresh, 3000);
