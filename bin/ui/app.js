// timer-service dashboard: a client of the service's JSON API (see /v1/openapi.json), nothing
// more. Pages are hash routes (#/, #/timers?…, #/timer?…, #/failed?…) so that a filtered list is
// a URL to share. Every text from the API goes into the page as text, never as HTML.
'use strict';

const TOKEN_KEY = 'timer-service-token';
const REFRESH_MS = 2000;
const STATES = ['scheduled', 'paused', 'reached', 'cancelled', 'failed'];

// ---------- DOM helpers ----------

/** An element with attributes (`on…` are listeners) and children (strings become text). */
function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith('on')) el.addEventListener(k.slice(2), v);
    else if (k === 'class') el.className = v;
    else el.setAttribute(k, v === true ? '' : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

const SVG = 'http://www.w3.org/2000/svg';
function s(tag, attrs, ...children) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, String(v));
  for (const c of children) el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return el;
}

const view = () => document.getElementById('view');

// ---------- time ----------

/** `2026-11-24 10:15:03.120Z`: UTC, readable, one width. */
function utc(iso) {
  if (!iso) return '—';
  return iso.replace('T', ' ');
}

/** `in 5 s`, `3 min ago`. */
function relative(iso) {
  if (!iso) return '';
  const ms = Date.parse(iso) - Date.now();
  const a = Math.abs(ms);
  let text;
  if (a < 1000) return 'now';
  if (a < 60e3) text = `${Math.round(a / 1e3)} s`;
  else if (a < 3600e3) text = `${Math.round(a / 60e3)} min`;
  else if (a < 172800e3) text = `${Math.round(a / 3600e3)} h`;
  else text = `${Math.round(a / 86400e3)} d`;
  return ms > 0 ? `in ${text}` : `${text} ago`;
}

/** `1.5 s`, `30 min`: a duration in ms, short. */
function duration(ms) {
  if (ms < 1000) return `${ms} ms`;
  if (ms < 60e3) return `${Math.round(ms / 100) / 10} s`;
  if (ms < 3600e3) return `${Math.round(ms / 60e3)} min`;
  return `${Math.round(ms / 360e3) / 10} h`;
}

/**
 * How the due time stands: relative to now, unless the timer waits for something else than
 * its time (a series awaiting its last fire's completion does not fire at its due time).
 */
function dueNote(t) {
  const awaiting = t.work && t.work.awaiting;
  if (t.state === 'Scheduled' && awaiting && Date.parse(t.dueAt) <= Date.now()) {
    return `waits for the completion of occurrence ${awaiting.occurrence}`;
  }
  return relative(t.dueAt);
}

/**
 * A tenant's next due time from a shared count (up to `http.counts_max_age` old): in the future,
 * relative to now; already past when counted by more than a second, a backlog; else due by now
 * (it was still to come when counted, and has most likely fired since).
 */
function nextDueText(nextDueAt, countedAt) {
  if (!nextDueAt) return '—';
  const due = Date.parse(nextDueAt);
  if (due > Date.now()) return relative(nextDueAt);
  const counted = Date.parse(countedAt);
  if (counted - due > 1000) return `${duration(counted - due)} overdue when counted`;
  return 'due by now';
}

/** The policies of a `ScheduleTimer`, as one line; `—` without any. */
function policyText(p) {
  if (!p) return '—';
  const parts = [`overlap ${p.overlap}`];
  if (p.completionTimeoutMs !== null) parts.push(`completion timeout ${duration(p.completionTimeoutMs)}`);
  if (p.catchUp !== null) {
    const within = [p.catchUpLimit !== null ? `limit ${p.catchUpLimit}` : null,
      p.catchUpWindowMs !== null ? `window ${duration(p.catchUpWindowMs)}` : null].filter(Boolean);
    parts.push(`catch-up ${p.catchUp}${within.length ? ` (${within.join(', ')})` : ''}`);
  }
  if (p.jitterMs !== null) parts.push(`jitter ${duration(p.jitterMs)}`);
  return parts.join(' · ');
}

/** What the policies recorded: the fire awaiting its completion, a buffered occurrence. */
function workText(w) {
  if (!w) return '—';
  const parts = [];
  if (w.awaiting) {
    const a = w.awaiting;
    parts.push(`awaiting the completion of occurrence ${a.occurrence} (fired ${utc(a.firedAt)}${a.deadline ? `, times out ${relative(a.deadline)}` : ''})`);
  }
  if (w.buffered) parts.push(`the occurrence due ${utc(w.buffered)} waits for it`);
  if (w.lastCompleted !== null) parts.push(`last completed: occurrence ${w.lastCompleted}`);
  return parts.length ? parts.join('; ') : '—';
}

/** A timer's own message, without its body: size, content type, headers. */
function messageText(m) {
  if (!m) return '— (the DueTimeReached event)';
  const headers = Object.keys(m.headers).length;
  return `${m.sizeBytes} bytes${m.contentType ? `, ${m.contentType}` : ''}, ${headers} header${headers === 1 ? '' : 's'}`;
}

/** A `datetime-local` value read as UTC → RFC 3339; empty stays empty. */
function localInputToUtc(value) {
  if (!value) return '';
  return (value.length === 16 ? value + ':00' : value) + 'Z';
}

/** RFC 3339 → a `datetime-local` value in UTC. */
function utcToLocalInput(iso) {
  if (!iso) return '';
  const d = new Date(iso);
  if (Number.isNaN(d.getTime())) return '';
  return d.toISOString().slice(0, 19);
}

const fmt = (n) => (n === null || n === undefined ? '—' : Number(n).toLocaleString('en-US'));

// ---------- the API ----------

const api = {
  token() {
    return sessionStorage.getItem(TOKEN_KEY) || '';
  },
  /** `{status, body}`; body is parsed JSON, or `{error: {message}}` for a non-JSON answer. */
  async call(method, path, body) {
    const headers = { Accept: 'application/json' };
    const token = api.token();
    if (token) headers.Authorization = `Bearer ${token}`;
    if (body !== undefined) headers['Content-Type'] = 'application/json';
    let response;
    try {
      response = await fetch(path, {
        method,
        headers,
        body: body === undefined ? undefined : JSON.stringify(body),
        cache: 'no-store',
      });
    } catch (e) {
      return { status: 0, body: { error: { reason: 'unreachable', message: `the service did not answer: ${e.message}` } } };
    }
    const text = await response.text();
    let parsed;
    try {
      parsed = text ? JSON.parse(text) : {};
    } catch {
      parsed = { error: { reason: 'not_json', message: text.slice(0, 500) } };
    }
    if (response.status === 401) signedOut();
    return { status: response.status, body: parsed };
  },
  get(path) {
    return api.call('GET', path);
  },
};

const enc = encodeURIComponent;
const timerPath = (tenant, id) => `/v1/tenants/${enc(tenant)}/timers/${enc(id)}`;

class ApiError extends Error {
  constructor(answer) {
    const e = answer.body && answer.body.error;
    super(e ? `${answer.status} ${e.reason}: ${e.message}${e.field ? ` (field ${e.field})` : ''}` : `answered ${answer.status}`);
    this.answer = answer;
  }
}

/** The body of a 2xx answer, or throws an ApiError naming what the API said. */
async function fetchOk(path) {
  const answer = await api.get(path);
  if (answer.status < 200 || answer.status > 299) throw new ApiError(answer);
  return answer.body;
}

// ---------- sign in ----------

let signInShown = false;

function signedOut() {
  if (signInShown) return;
  const hadToken = Boolean(api.token());
  sessionStorage.removeItem(TOKEN_KEY);
  stopRefresh();
  signInShown = true;
  document.getElementById('sign-out').hidden = true;
  const message = hadToken ? 'The service refused this token.' : '';
  const input = h('input', { id: 'token', type: 'password', autocomplete: 'current-password', required: true });
  const error = h('p', { id: 'sign-in-error', class: 'error', role: 'alert' }, message);
  const form = h('form', {
    onsubmit: async (ev) => {
      ev.preventDefault();
      sessionStorage.setItem(TOKEN_KEY, input.value.trim());
      signInShown = false;
      // Any key that may read answers this (the status needs the admin scope).
      const answer = await api.get('/v1/summary?limit=1');
      if (answer.status === 200) {
        route();
      } else if (answer.status !== 401) {
        error.textContent = new ApiError(answer).message;
      }
    },
  },
  h('label', { for: 'token' }, 'API key, token or JWT'), input,
  h('button', { type: 'submit', class: 'primary', id: 'sign-in' }, 'Sign in'), error);
  view().replaceChildren(h('section', { class: 'panel login' },
    h('h1', {}, 'Sign in'),
    h('p', { class: 'muted' }, 'The token is kept in this browser tab only, until it closes or you sign out.'),
    form));
  input.focus();
}

document.getElementById('sign-out').addEventListener('click', () => {
  sessionStorage.removeItem(TOKEN_KEY);
  signedOut();
});

// ---------- confirmation ----------

/**
 * Asks before an action. `field` (optional): `{label, value, type}` for one input whose value
 * is passed to the answer. Resolves to `{ok, value}`.
 */
function confirmAction(title, text, okLabel, field) {
  const dialog = document.getElementById('confirm');
  document.getElementById('confirm-title').textContent = title;
  document.getElementById('confirm-text').textContent = text;
  const wrap = document.getElementById('confirm-field');
  const input = document.getElementById('confirm-input');
  wrap.hidden = !field;
  if (field) {
    document.getElementById('confirm-label').textContent = field.label;
    input.type = field.type || 'text';
    if (field.type === 'datetime-local') input.step = '1';
    input.value = field.value || '';
  }
  const ok = document.getElementById('confirm-ok');
  ok.textContent = okLabel;
  return new Promise((resolve) => {
    const done = (result) => {
      ok.removeEventListener('click', onOk);
      back.removeEventListener('click', onBack);
      dialog.removeEventListener('cancel', onBack);
      dialog.close();
      resolve(result);
    };
    const onOk = () => done({ ok: true, value: input.value });
    const onBack = (ev) => {
      if (ev) ev.preventDefault();
      done({ ok: false });
    };
    const back = document.getElementById('confirm-back');
    ok.addEventListener('click', onOk);
    back.addEventListener('click', onBack);
    dialog.addEventListener('cancel', onBack);
    dialog.showModal();
    (field ? input : ok).focus();
  });
}

/** Shows an API answer: the outcome, or the error with its reason (`firing`, …). */
function showAnswer(box, what, answer) {
  const good = answer.status >= 200 && answer.status < 300;
  box.className = `answer ${good ? 'good' : 'refused'}`;
  box.hidden = false;
  const e = answer.body && answer.body.error;
  const outcome = answer.body && answer.body.outcome;
  const summary = good
    ? `${what}: ${answer.status} ${outcome || 'ok'}`
    : `${what}: ${answer.status} ${e ? e.reason : ''}${e && e.reason === 'firing' ? ' — it is being published right now; try again in a moment' : ''}`;
  box.replaceChildren(h('strong', { class: 'answer-summary' }, summary),
    h('pre', {}, JSON.stringify(answer.body, null, 2)));
}

// ---------- routing and refresh ----------

let refreshTimer = null;
let generation = 0;

function stopRefresh() {
  if (refreshTimer) clearTimeout(refreshTimer);
  refreshTimer = null;
}

/**
 * Runs `fn` now and then every `ms` until the page changes; one run at a time. An error of the
 * first run goes to the caller (the page shows it); later ones are logged and retried.
 */
async function refreshEvery(fn, ms = REFRESH_MS) {
  const mine = generation;
  const again = () => {
    if (mine !== generation || signInShown) return;
    refreshTimer = setTimeout(async () => {
      if (mine !== generation) return;
      try {
        await fn();
      } catch (e) {
        console.warn(e);
      }
      again();
    }, ms);
  };
  await fn();
  again();
}

function parseHash() {
  const raw = location.hash.replace(/^#/, '') || '/';
  const [path, query] = raw.split('?');
  return { path, params: new URLSearchParams(query || '') };
}

function go(path, params) {
  const q = params.toString();
  location.hash = `#${path}${q ? `?${q}` : ''}`;
}

const pages = {
  '/': overview,
  '/timers': timersPage,
  '/timer': timerPage,
  '/failed': failedPage,
};

async function route() {
  generation += 1;
  stopRefresh();
  const { path, params } = parseHash();
  const page = pages[path] || notFound;
  const name = path === '/' ? 'overview' : path.slice(1);
  for (const a of document.querySelectorAll('.top nav a')) {
    const current = a.dataset.page === name || (name === 'timer' && a.dataset.page === 'timers');
    if (current) a.setAttribute('aria-current', 'page');
    else a.removeAttribute('aria-current');
  }
  signInShown = false;
  document.getElementById('sign-out').hidden = !api.token();
  try {
    await page(params);
  } catch (e) {
    if (!signInShown) view().replaceChildren(h('p', { class: 'error', role: 'alert' }, e.message));
  }
}

function notFound() {
  view().replaceChildren(h('h1', {}, 'No such page'), h('p', {}, h('a', { href: '#/' }, 'Overview')));
}

window.addEventListener('hashchange', route);
window.addEventListener('DOMContentLoaded', route);

// ---------- overview ----------

async function overview() {
  const cards = {};
  const card = (key, label) => {
    cards[key] = h('div', { class: 'value', id: `card-${key}` }, '—');
    return h('div', { class: 'card' }, h('div', { class: 'label' }, label), cards[key]);
  };
  const chart = h('div', { id: 'lateness-chart', class: 'chart-box' });
  const tenantsBody = h('tbody', { id: 'tenants' });
  const nextBody = h('tbody', { id: 'next-due' });
  const waitingBody = h('tbody', { id: 'waiting' });
  const instancesBody = h('tbody', { id: 'instances' });
  const more = h('p', { class: 'muted', id: 'more-tenants', hidden: true });
  const countedAt = h('span', { class: 'muted small', id: 'counted-at' });
  const failure = h('p', { class: 'error', id: 'overview-error', role: 'alert', hidden: true });
  // A key without the admin scope sees its tenants, not the service's own figures.
  const restricted = h('p', { class: 'muted', id: 'overview-restricted', hidden: true },
    'This key sees its own tenants only: the service\'s health, fires and lateness need a key with the admin scope.');
  view().replaceChildren(
    h('h1', {}, 'Overview'),
    failure,
    restricted,
    h('div', { class: 'cards' },
      card('store', 'Store'), card('broker', 'Broker'), card('instance', 'Instance'),
      card('fires', 'Fires per second (last minute)'), card('lateness', 'Lateness p50 / p99 (last minute)'),
      card('timers', 'Scheduled · paused · failed')),
    h('section', { class: 'panel' },
      h('h2', {}, 'Lateness and fires, last hour (this instance, per minute)'),
      chart,
      h('div', { class: 'legend' },
        h('span', {}, h('span', { class: 'swatch p50' }), 'p50 ms'),
        h('span', {}, h('span', { class: 'swatch p99' }), 'p99 ms'),
        h('span', {}, h('span', { class: 'swatch bars' }), 'fires per minute'))),
    h('section', { class: 'panel' },
      h('h2', {}, 'Who waits'),
      h('p', { class: 'muted small' },
        'Timers due and not yet claimed, from the store (every instance); fires and lateness in the last minute, on this instance.'),
      h('div', { class: 'table-wrap' }, h('table', {},
        h('thead', {}, h('tr', {},
          h('th', {}, 'Tenant'), h('th', { class: 'num' }, 'Due now'), h('th', {}, 'Waiting'),
          h('th', { class: 'num' }, 'Fired 1 min'), h('th', { class: 'num' }, 'Lateness p50 / p99'),
          h('th', { class: 'num hide-narrow' }, 'Most late'))),
        waitingBody))),
    h('section', { class: 'panel' },
      h('h2', {}, 'Instances'),
      h('p', { class: 'muted small' },
        'The live instances on this store, with the release each runs (during a rolling upgrade, two) and the timers each holds now.'),
      h('div', { class: 'table-wrap' }, h('table', {},
        h('thead', {}, h('tr', {},
          h('th', {}, 'Instance'), h('th', {}, 'Version'), h('th', { class: 'hide-narrow' }, 'Revision'),
          h('th', {}, 'Started (UTC)'), h('th', {}, 'Last seen (UTC)'), h('th', { class: 'num' }, 'Leases'))),
        instancesBody))),
    h('div', { class: 'grid2' },
      h('section', { class: 'panel' },
        h('div', { class: 'panel-head' }, h('h2', {}, 'Tenants'), countedAt),
        h('div', { class: 'table-wrap' }, h('table', {},
          h('thead', {}, h('tr', {},
            h('th', {}, 'Tenant'), h('th', { class: 'num' }, 'Scheduled'), h('th', { class: 'num' }, 'Paused'),
            h('th', { class: 'num' }, 'Failed'), h('th', { class: 'num' }, 'Fired 1 h'),
            h('th', { class: 'hide-narrow' }, 'Next due'))),
          tenantsBody)),
        more),
      h('section', { class: 'panel' },
        h('h2', {}, 'Next due'),
        h('div', { class: 'table-wrap' }, h('table', {},
          h('thead', {}, h('tr', {}, h('th', {}, 'Due (UTC)'), h('th', {}, 'Tenant'), h('th', {}, 'Timer'))),
          nextBody)))),
  );
  let lastHour = [];
  const mine = generation;
  const onResize = () => {
    if (mine !== generation) window.removeEventListener('resize', onResize);
    else chart.replaceChildren(latenessChart(lastHour, chart.clientWidth));
  };
  window.addEventListener('resize', onResize);
  const showStatus = (status) => {
    lastHour = status.lastHour;
    const health = (part) => h('span', { class: part.healthy ? 'ok' : 'bad', title: part.error || '' },
      `${part.kind} ${part.healthy ? 'healthy' : 'unhealthy'}`);
    cards.store.replaceChildren(health(status.store));
    cards.broker.replaceChildren(health(status.broker));
    cards.instance.className = 'value small';
    cards.instance.replaceChildren(`${status.instanceId} · v${status.version} (${status.revision})`);
    cards.fires.textContent = (status.lastMinute.fired / 60).toFixed(1);
    const l = status.lastMinute.latenessMs;
    cards.lateness.textContent = l.p50 === null ? '—' : `${l.p50} / ${l.p99} ms`;
    cards.timers.textContent = [status.timers.pending, status.timers.paused, status.timers.failed].map(fmt).join(' · ');
    chart.replaceChildren(latenessChart(lastHour, chart.clientWidth));
    const rows = waitingRows(status.backlog, status.lastMinute);
    waitingBody.replaceChildren(...rows.map((r) => h('tr', { 'data-tenant': r.tenantId },
      h('td', { class: 'id' }, h('a', { href: `#/timers?tenant=${enc(r.tenantId)}` }, r.tenantId)),
      h('td', { class: 'num' }, r.due),
      h('td', {}, r.waiting),
      h('td', { class: 'num' }, r.fired),
      h('td', { class: 'num' }, r.lateness),
      h('td', { class: 'num hide-narrow' }, r.mostLate))));
    const instances = status.instances || [];
    instancesBody.replaceChildren(...instances.map((i) => h('tr', { 'data-instance': i.id },
      h('td', { class: 'id' }, i.id === status.instanceId ? `${i.id} (this one)` : i.id),
      h('td', {}, i.version === null ? '0.1.0 or older' : i.version),
      h('td', { class: 'id hide-narrow' }, i.revision || '—'),
      h('td', { class: 'time' }, utc(i.startedAt)),
      h('td', { class: 'time' }, i.lastSeenAt ? utc(i.lastSeenAt) : '—'),
      h('td', { class: 'num' }, fmt(i.leases)))));
    if (instances.length === 0) {
      instancesBody.replaceChildren(h('tr', {}, h('td', { colspan: 6, class: 'muted' },
        status.instances ? 'No live instance listed.' : 'The store could not list the instances.')));
    }
    if (rows.length === 0) {
      waitingBody.replaceChildren(h('tr', {}, h('td', { colspan: 6, class: 'muted' },
        status.backlog ? 'Nothing waits, and nothing fired in the last minute.' : 'The backlog could not be counted.')));
    }
  };
  await refreshEvery(async () => {
    let status, summary;
    try {
      let statusAnswer;
      [statusAnswer, summary] = await Promise.all([api.get('/v1/status'), fetchOk('/v1/summary?limit=100')]);
      if (statusAnswer.status === 403) status = null;
      else if (statusAnswer.status === 200) status = statusAnswer.body;
      else throw new ApiError(statusAnswer);
    } catch (e) {
      // The last figures stay; this line says they are not current.
      failure.textContent = `Not refreshed: ${e.message}`;
      failure.hidden = false;
      return;
    }
    failure.hidden = true;
    // Counting reads every timer, so the service shares one count for a few seconds.
    countedAt.textContent = `counted ${summary.countedAt.slice(11, 19)} UTC`;
    restricted.hidden = status !== null;
    if (status === null) {
      // The sums of the key's own tenants stand in for the service's totals.
      const sum = (state) => summary.tenants.reduce((n, t) => n + (t.counts[state] || 0), 0);
      cards.timers.textContent = ['scheduled', 'paused', 'failed'].map((state) => fmt(sum(state))).join(' · ');
      chart.replaceChildren(h('p', { class: 'muted' }, 'Needs the admin scope.'));
      waitingBody.replaceChildren(h('tr', {}, h('td', { colspan: 6, class: 'muted' }, 'Needs the admin scope.')));
      instancesBody.replaceChildren(h('tr', {}, h('td', { colspan: 6, class: 'muted' }, 'Needs the admin scope.')));
    } else {
      showStatus(status);
    }
    tenantsBody.replaceChildren(...summary.tenants.map((t) => h('tr', { 'data-tenant': t.tenantId },
      h('td', { class: 'id' }, h('a', { href: `#/timers?tenant=${enc(t.tenantId)}` }, t.tenantId)),
      h('td', { class: 'num' }, fmt(t.counts.scheduled)),
      h('td', { class: 'num' }, fmt(t.counts.paused)),
      h('td', { class: 'num' }, t.counts.failed
        ? h('a', { href: `#/failed?tenant=${enc(t.tenantId)}` }, fmt(t.counts.failed)) : '0'),
      h('td', { class: 'num' }, fmt(t.firedLastHour)),
      h('td', { class: 'hide-narrow' }, nextDueText(t.nextDueAt, summary.countedAt)))));
    if (summary.tenants.length === 0) {
      tenantsBody.replaceChildren(h('tr', {}, h('td', { colspan: 6, class: 'muted' }, 'No timers yet.')));
    }
    more.hidden = !summary.nextCursor;
    more.textContent = 'The first 100 tenants are shown; open a tenant by its name on the Timers page.';
    nextBody.replaceChildren(...(await nextDue(summary.tenants)).map((t) => h('tr', {},
      h('td', { class: 'time' }, utc(t.dueAt)),
      h('td', { class: 'id' }, t.tenantId),
      h('td', { class: 'id' }, h('a', { href: `#/timer?tenant=${enc(t.tenantId)}&id=${enc(t.serviceCallId)}` }, t.serviceCallId)))));
  });
}

/**
 * One row per tenant that waits (the store's backlog, longest waiting first) or fired in the
 * last minute on this instance (most late first), as text. How long a tenant waits is told at the
 * count (up to `http.counts_max_age` old), as `nextDueText` does.
 */
function waitingRows(backlog, lastMinute) {
  const rows = new Map();
  const row = (tenantId) => {
    if (!rows.has(tenantId)) rows.set(tenantId, { tenantId, due: '0', waiting: '—', fired: '0', lateness: '—', mostLate: '—' });
    return rows.get(tenantId);
  };
  if (backlog) {
    const counted = Date.parse(backlog.countedAt);
    for (const t of backlog.byTenant) {
      const r = row(t.tenantId);
      r.due = fmt(t.due);
      r.waiting = `${duration(Math.max(0, counted - Date.parse(t.dueSince)))} when counted`;
    }
  }
  for (const t of lastMinute.byTenant) {
    const r = row(t.tenantId);
    r.fired = fmt(t.fired);
    r.lateness = `${t.latenessMs.p50} / ${t.latenessMs.p99} ms`;
    r.mostLate = `${t.maxLatenessMs} ms`;
  }
  return [...rows.values()];
}

/** The 10 earliest Scheduled timers: they are among the first 10 of the 10 tenants due first. */
async function nextDue(tenants) {
  const soonest = tenants.filter((t) => t.nextDueAt)
    .sort((a, b) => Date.parse(a.nextDueAt) - Date.parse(b.nextDueAt))
    .slice(0, 10);
  const pages = await Promise.all(soonest.map((t) =>
    fetchOk(`/v1/tenants/${enc(t.tenantId)}/timers?state=scheduled&limit=10`).catch(() => ({ timers: [] }))));
  return pages.flatMap((p) => p.timers)
    .sort((a, b) => a.dueTimeMs - b.dueTimeMs)
    .slice(0, 10);
}

/** p50 and p99 lines and fires-per-minute bars over the 60 minutes up to now. */
function latenessChart(minutes, width) {
  // Drawn at the box's own width, so text and lines keep their size on any screen.
  const W = Math.max(280, Math.round(width || 600)), H = 180, L = 48, R = 10, T = 10, B = 24;
  const now = Math.floor(Date.now() / 60000);
  // 60 slots, one a minute, the current one last.
  const x = (minute) => L + ((minute - (now - 59) + 0.5) / 60) * (W - L - R);
  const top = Math.max(1, ...minutes.map((m) => m.latenessMs.p99 || 0));
  const scale = niceCeiling(top);
  const y = (ms) => T + (1 - ms / scale) * (H - T - B);
  const maxFired = Math.max(1, ...minutes.map((m) => m.fired));
  const svg = s('svg', {
    class: 'chart', viewBox: `0 0 ${W} ${H}`, width: W, height: H, role: 'img',
    'aria-label': minutes.length
      ? `Lateness per minute: latest p50 ${minutes[minutes.length - 1].latenessMs.p50} ms, p99 ${minutes[minutes.length - 1].latenessMs.p99} ms`
      : 'No fires in the last hour',
  });
  const barWidth = Math.max(2, (W - L - R) / 60 - 2);
  for (const m of minutes) {
    const minute = Math.floor(Date.parse(m.start) / 60000);
    if (minute < now - 59) continue;
    const height = (m.fired / maxFired) * (H - T - B);
    svg.append(s('rect', { class: 'bar', x: x(minute) - barWidth / 2, y: H - B - height, width: barWidth, height }));
  }
  for (const tick of [0, scale / 2, scale]) {
    svg.append(s('line', { class: 'axis', x1: L, x2: W - R, y1: y(tick), y2: y(tick) }));
    svg.append(s('text', { x: L - 4, y: y(tick) + 4, 'text-anchor': 'end' }, `${tick} ms`));
  }
  for (const ago of W < 400 ? [60, 30, 0] : [60, 45, 30, 15, 0]) {
    svg.append(s('text', { x: x(now - Math.min(ago, 59)), y: H - 6, 'text-anchor': 'middle' }, ago ? `-${ago} min` : 'now'));
  }
  for (const p of ['p50', 'p99']) {
    const shown = minutes.filter((m) => m.latenessMs[p] !== null && Date.parse(m.start) / 60000 >= now - 59);
    const at = (m) => [x(Math.floor(Date.parse(m.start) / 60000)), y(m.latenessMs[p])];
    if (shown.length > 1) {
      svg.append(s('polyline', { class: p, points: shown.map((m) => at(m).map((v) => v.toFixed(1)).join(',')).join(' ') }));
    }
    for (const m of shown) {
      const [cx, cy] = at(m);
      svg.append(s('circle', { class: `dot-${p}`, cx: cx.toFixed(1), cy: cy.toFixed(1), r: 3 }));
    }
  }
  return svg;
}

function niceCeiling(v) {
  const p = 10 ** Math.floor(Math.log10(v));
  for (const m of [1, 2, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

// ---------- the timer list ----------

async function timersPage(params) {
  const tenant = params.get('tenant') || '';
  const states = (params.get('state') || '').split(',').filter(Boolean);
  const field = (name, label, attrs) => h('label', {}, label,
    h('input', { name, id: `f-${name}`, value: params.get(name) || '', ...attrs }));
  const form = h('form', { class: 'filters', id: 'filters', onsubmit: (ev) => {
    ev.preventDefault();
    const data = new FormData(form);
    const next = new URLSearchParams();
    next.set('tenant', String(data.get('tenant') || '').trim());
    const chosen = STATES.filter((st) => data.get(`state-${st}`));
    if (chosen.length) next.set('state', chosen.join(','));
    for (const name of ['prefix', 'recurring', 'limit']) {
      const v = String(data.get(name) || '');
      if (v) next.set(name, v);
    }
    for (const name of ['dueAfter', 'dueBefore']) {
      const v = localInputToUtc(String(data.get(name) || ''));
      if (v) next.set(name, v);
    }
    go('/timers', next);
  } },
  field('tenant', 'Tenant', { required: true, list: 'tenant-names', autocomplete: 'off' }),
  h('fieldset', {}, h('legend', {}, 'State'), STATES.map((st) => h('label', {},
    h('input', { type: 'checkbox', name: `state-${st}`, id: `f-state-${st}`, checked: states.includes(st) }), st))),
  field('prefix', 'Id prefix', { autocomplete: 'off' }),
  h('label', {}, 'Due at or after (UTC)', h('input', { type: 'datetime-local', step: 1, name: 'dueAfter', id: 'f-dueAfter', value: utcToLocalInput(params.get('dueAfter')) })),
  h('label', {}, 'Due before (UTC)', h('input', { type: 'datetime-local', step: 1, name: 'dueBefore', id: 'f-dueBefore', value: utcToLocalInput(params.get('dueBefore')) })),
  h('label', {}, 'Recurring', h('select', { name: 'recurring', id: 'f-recurring' },
    [['', 'either'], ['true', 'recurring'], ['false', 'one-shot']].map(([v, text]) =>
      h('option', { value: v, selected: (params.get('recurring') || '') === v }, text)))),
  h('label', {}, 'Per page', h('select', { name: 'limit', id: 'f-limit' },
    ['25', '100', '500'].map((v) => h('option', { value: v, selected: (params.get('limit') || '100') === v }, v)))),
  h('button', { type: 'submit', class: 'primary', id: 'apply' }, 'Show'));
  const datalist = h('datalist', { id: 'tenant-names' });
  const result = h('section', { class: 'panel', id: 'results', 'aria-live': 'polite' });
  view().replaceChildren(h('h1', {}, 'Timers'), h('section', { class: 'panel' }, form, datalist), result);
  fetchOk('/v1/summary?limit=1000').then((page) => datalist.replaceChildren(
    ...page.tenants.map((t) => h('option', { value: t.tenantId })))).catch(() => {});
  if (!tenant) {
    result.replaceChildren(h('p', { class: 'muted' }, 'Choose a tenant.'));
    return;
  }
  const query = new URLSearchParams();
  for (const name of ['state', 'prefix', 'dueAfter', 'dueBefore', 'recurring', 'limit', 'cursor']) {
    if (params.get(name)) query.set(name, params.get(name));
  }
  const answer = await api.get(`/v1/tenants/${enc(tenant)}/timers?${query}`);
  if (answer.status !== 200) {
    result.replaceChildren(h('p', { class: 'error', role: 'alert', id: 'list-error' }, new ApiError(answer).message));
    return;
  }
  const page = answer.body;
  const rows = page.timers.map((t) => h('tr', { 'data-id': t.serviceCallId },
    h('td', { class: 'id' }, h('a', { href: `#/timer?tenant=${enc(t.tenantId)}&id=${enc(t.serviceCallId)}` }, t.serviceCallId)),
    h('td', {}, h('span', { class: `state ${t.state}` }, t.state)),
    h('td', { class: 'time' }, utc(t.dueAt)),
    h('td', { class: 'hide-narrow' }, t.recurrence ? t.recurrence.cron : 'one-shot'),
    h('td', { class: 'err hide-narrow' }, t.lastError || '')));
  const first = new URLSearchParams(params);
  first.delete('cursor');
  const next = new URLSearchParams(params);
  if (page.nextCursor) next.set('cursor', page.nextCursor);
  result.replaceChildren(
    h('div', { class: 'table-wrap' }, h('table', { id: 'timer-list' },
      h('thead', {}, h('tr', {}, h('th', {}, 'Timer'), h('th', {}, 'State'), h('th', {}, 'Due (UTC)'),
        h('th', { class: 'hide-narrow' }, 'Recurrence'), h('th', { class: 'hide-narrow' }, 'Last error'))),
      h('tbody', {}, rows.length ? rows : h('tr', {}, h('td', { colspan: 5, class: 'muted' }, 'No timers match.'))))),
    h('div', { class: 'pager' },
      params.get('cursor') ? h('a', { href: `#/timers?${first}`, id: 'first-page' }, 'First page') : null,
      page.nextCursor ? h('a', { href: `#/timers?${next}`, id: 'next-page' }, 'Next page') : null,
      h('span', { class: 'muted' }, `${page.timers.length} shown`)));
}

// ---------- one timer ----------

async function timerPage(params) {
  const tenant = params.get('tenant') || '';
  const id = params.get('id') || '';
  const path = timerPath(tenant, id);
  const answerBox = h('div', { class: 'answer', id: 'answer', role: 'status', 'aria-live': 'polite', hidden: true });
  const head = h('h1', {}, id);
  const actions = h('div', { class: 'actions', id: 'actions' });
  const fields = h('dl', { class: 'fields', id: 'fields' });
  const payload = h('pre', { id: 'payload' });
  const recurrence = h('div', { id: 'recurrence' });
  const history = h('ol', { class: 'timeline', id: 'history' });
  view().replaceChildren(
    h('p', {}, h('a', { href: `#/timers?tenant=${enc(tenant)}` }, `← ${tenant}`)),
    head, actions, answerBox,
    h('div', { class: 'grid2' },
      h('section', { class: 'panel' }, h('h2', {}, 'Fields'), fields,
        h('h2', { class: 'gap' }, 'Payload'), payload),
      h('section', { class: 'panel' }, h('h2', {}, 'Recurrence'), recurrence)),
    h('section', { class: 'panel' }, h('h2', {}, 'History'), history));

  const act = async (label, method, url, body) => {
    const answer = await api.call(method, url, body);
    showAnswer(answerBox, label, answer);
    await load();
  };
  const button = (label, cls, onclick, enabled) =>
    h('button', { type: 'button', class: cls, onclick, disabled: !enabled, id: `do-${label.toLowerCase().replace(/ /g, '-')}` }, label);

  const load = async () => {
    const answer = await api.get(`${path}?next=5`);
    if (answer.status !== 200) {
      head.replaceChildren(id, ' ', h('span', { class: 'state Cancelled' }, answer.status === 404 ? 'not found' : 'error'));
      fields.replaceChildren(h('dd', { class: 'error' }, new ApiError(answer).message));
      actions.replaceChildren();
      return;
    }
    const t = answer.body;
    head.replaceChildren(`${t.serviceCallId} `, h('span', { class: `state ${t.state}`, id: 'timer-state' }, t.state));
    const live = t.state === 'Scheduled' || t.state === 'Paused';
    actions.replaceChildren(
      button('Cancel', 'danger', async () => {
        const c = await confirmAction('Cancel this timer?', t.recurrence ? 'The whole series ends; nothing more fires.' : 'It will not fire.', 'Cancel timer');
        if (c.ok) await act('Cancel', 'DELETE', path);
      }, live),
      t.state === 'Paused'
        ? button('Resume', '', async () => {
          const c = await confirmAction('Resume this timer?', t.recurrence ? 'The series goes on with its next occurrence from now.' : 'If its due time passed, it fires at once.', 'Resume');
          if (c.ok) await act('Resume', 'POST', `${path}/resume`);
        }, true)
        : button('Pause', '', async () => {
          const c = await confirmAction('Pause this timer?', 'It does not fire until resumed. A note is kept in its history.', 'Pause', { label: 'Note (optional)', value: '' });
          if (c.ok) await act('Pause', 'POST', `${path}/pause`, c.value ? { note: c.value } : undefined);
        }, t.state === 'Scheduled'),
      button('Trigger now', '', async () => {
        const c = await confirmAction('Fire one extra occurrence now?', 'A DueTimeReached with "trigger": "manual" goes out; the schedule does not move.', 'Trigger');
        if (c.ok) await act('Trigger', 'POST', `${path}/trigger`);
      }, live),
      button('Retry', '', async () => {
        const c = await confirmAction('Publish this failed timer again?', 'It is Scheduled again at its own due time, so it fires at once; its attempts start from 0.', 'Retry');
        if (c.ok) await act('Retry', 'POST', `${path}/retry`);
      }, t.state === 'Failed'),
      button('Reschedule', '', async () => {
        const c = await confirmAction('Reschedule this timer?', 'It will be due at this time (UTC); its payload, correlation id, target, message, completion timeout and trace context stay.', 'Reschedule',
          { label: 'New due time (UTC)', value: utcToLocalInput(t.dueAt), type: 'datetime-local' });
        if (!c.ok) return;
        const command = { tenantId: t.tenantId, serviceCallId: t.serviceCallId, dueAt: localInputToUtc(c.value) };
        if (t.payload !== null) command.payload = t.payload;
        if (t.correlationId !== null) command.correlationId = t.correlationId;
        if (t.target !== null) command.target = t.target;
        // A reschedule replaces the timer's policy and trace context too: the same again.
        if (t.policy && t.policy.completionTimeoutMs !== null) command.completionTimeout = t.policy.completionTimeoutMs;
        if (t.traceparent !== null) command.traceparent = t.traceparent;
        if (t.tracestate) command.tracestate = t.tracestate;
        if (t.message !== null) {
          // A reschedule replaces the message: send it again as it is, body included.
          const full = await api.get(`${path}?body=true`);
          if (full.status !== 200 || !full.body.message) {
            showAnswer(answerBox, 'Reschedule', full);
            return;
          }
          const m = full.body.message;
          command.message = { bodyBase64: m.bodyBase64, headers: m.headers };
          if (m.contentType !== null) command.message.contentType = m.contentType;
        }
        await act('Reschedule', 'POST', '/v1/timers', command);
      }, live && !t.recurrence));
    const row = (k, v) => [h('dt', {}, k), h('dd', {}, v)];
    fields.replaceChildren(
      ...row('Tenant', t.tenantId),
      ...row('Id', t.serviceCallId),
      ...row('State', t.state),
      ...row('Due (UTC)', `${utc(t.dueAt)} (${dueNote(t)})`),
      ...row('Due (ms)', String(t.dueTimeMs)),
      ...row('Registered', utc(t.registeredAt)),
      ...row('Last fired', utc(t.reachedAt)),
      ...row('Attempts', String(t.attempts)),
      ...row('Last error', t.lastError || '—'),
      ...row('Next attempt', t.nextAttemptAt ? `${utc(t.nextAttemptAt)} (${relative(t.nextAttemptAt)})` : '—'),
      ...row('Correlation id', t.correlationId || '—'),
      ...row('Policy', policyText(t.policy)),
      ...row('Work', workText(t.work)),
      ...row('Target', t.target ? JSON.stringify(t.target) : '— (the events destination)'),
      ...row('Message', messageText(t.message)),
      ...row('Trace', !t.traceId ? '—'
        : t.traceUrl ? h('a', { href: t.traceUrl, target: '_blank', rel: 'noopener noreferrer', class: 'id' }, t.traceId)
          : h('span', { class: 'id' }, t.traceId)));
    payload.textContent = t.payload === null ? '(none)' : JSON.stringify(t.payload, null, 2);
    if (t.recurrence) {
      const r = t.recurrence;
      recurrence.replaceChildren(
        h('dl', { class: 'fields' },
          ...row('Cron', r.cron), ...row('Time zone', r.timeZone),
          ...row('Ends', r.endAt ? utc(r.endAt) : '—'), ...row('At most', r.maxOccurrences === null ? '—' : String(r.maxOccurrences)),
          ...row('Fired so far', String(t.occurrences))),
        h('h2', { class: 'gap' }, 'Next occurrences'),
        h('div', { class: 'table-wrap' }, h('table', { id: 'next-occurrences' },
          h('thead', {}, h('tr', {}, h('th', {}, 'UTC'), h('th', {}, r.timeZone))),
          h('tbody', {}, (t.nextOccurrences || []).map((o) => h('tr', {}, h('td', { class: 'time' }, utc(o.utc)), h('td', { class: 'time' }, o.local.replace('T', ' '))))))));
    } else {
      recurrence.replaceChildren(h('p', { class: 'muted' }, 'A one-shot timer.'));
    }
    const entries = await historyOf(path);
    history.replaceChildren(...(entries.length ? entries.map(historyItem)
      : [h('li', { class: 'muted' }, 'No history (the store keeps none, or engine.history_per_timer is 0).')]));
  };
  await refreshEvery(load, 5000);
}

/** Up to 500 of a timer's history entries, oldest first. */
async function historyOf(path) {
  const entries = [];
  let cursor = '';
  for (let i = 0; i < 5; i += 1) {
    const answer = await api.get(`${path}/history?limit=100${cursor ? `&cursor=${enc(cursor)}` : ''}`);
    if (answer.status !== 200) break;
    entries.push(...answer.body.history);
    if (!answer.body.nextCursor) break;
    cursor = answer.body.nextCursor;
  }
  return entries;
}

function historyItem(e) {
  const what = {
    created: () => `created, due ${utc(e.dueAt)}`,
    rescheduled: () => `rescheduled to ${utc(e.dueAt)}`,
    paused: () => `paused${e.note ? `: “${e.note}”` : ''}`,
    resumed: () => (e.dueAt ? `resumed, due ${utc(e.dueAt)}` : 'resumed; the series had ended'),
    skipped: () => `skipped ${e.atLeast ? 'at least ' : ''}${e.count} occurrence${e.count === 1 ? '' : 's'} (${utc(e.first)} … ${utc(e.last)})`,
    triggered: () => `triggered by hand (event ${e.eventId})`,
    fired: () => `fired${e.occurrence ? ` occurrence ${e.occurrence}` : ''}, ${e.latenessMs} ms late (due ${utc(e.dueAt)}, by ${e.instance})${e.answer ? `: ${e.answer}` : ''}`,
    publish_failed: () => `publish attempt ${e.attempt} failed: ${e.error}`,
    given_up: () => `failed after ${e.attempts} attempts: ${e.error}`,
    cancelled: () => 'cancelled',
    retried: () => 'retried by hand: publishing again, attempts from 0',
  }[e.type];
  return h('li', { 'data-type': e.type },
    h('span', { class: 'muted num' }, `${utc(e.at)} `),
    h('span', { class: 'what' }, what ? what() : e.type));
}

// ---------- failed ----------

async function failedPage(params) {
  const tenant = params.get('tenant') || '';
  const list = h('section', { class: 'panel', id: 'failed-list' });
  const retrying = h('section', { class: 'panel', id: 'retrying-list' });
  const answerBox = h('div', { class: 'answer', id: 'answer', role: 'status', 'aria-live': 'polite', hidden: true });
  const dead = h('section', { class: 'panel', id: 'dead-letters' });
  view().replaceChildren(h('h1', {}, tenant ? `Failed: ${tenant}` : 'Failed'), answerBox, list, retrying, dead);
  if (!tenant) {
    const page = await fetchOk('/v1/summary?limit=1000');
    const failing = page.tenants.filter((t) => t.counts.failed > 0);
    list.replaceChildren(h('h2', {}, 'Tenants with failed timers'),
      failing.length
        ? h('div', { class: 'table-wrap' }, h('table', {},
          h('thead', {}, h('tr', {}, h('th', {}, 'Tenant'), h('th', { class: 'num' }, 'Failed'), h('th', { class: 'num' }, 'Failed 24 h'))),
          h('tbody', {}, failing.map((t) => h('tr', {},
            h('td', { class: 'id' }, h('a', { href: `#/failed?tenant=${enc(t.tenantId)}` }, t.tenantId)),
            h('td', { class: 'num' }, fmt(t.counts.failed)), h('td', { class: 'num' }, fmt(t.failedLast24h)))))))
        : h('p', { class: 'muted' }, 'No tenant has failed timers.'),
      h('p', { class: 'muted' }, 'Open a tenant to retry its failed timers and see the ones whose publish is being retried.'));
    retrying.hidden = true;
  } else {
    // A timer of this page, answered in the box above the lists, which are then read again.
    const act = async (label, method, url, body) => {
      const answer = await api.call(method, url, body);
      showAnswer(answerBox, label, answer);
      await loadLists();
    };
    const timerLink = (t) => h('a', { href: `#/timer?tenant=${enc(t.tenantId)}&id=${enc(t.serviceCallId)}` }, t.serviceCallId);
    // A row of either list: the timer, a time (hidden on a phone), its attempts, its last error
    // and one action.
    const troubleRow = (t, at, action) => h('tr', { 'data-id': t.serviceCallId },
      h('td', { class: 'id' }, timerLink(t)),
      h('td', { class: 'time hide-narrow' }, utc(at)),
      h('td', { class: 'num' }, String(t.attempts)),
      h('td', { class: 'err' }, t.lastError || ''),
      h('td', {}, action));
    const table = (heads, rows, empty) => h('div', { class: 'table-wrap' }, h('table', {},
      h('thead', {}, h('tr', {}, heads.map(([text, cls]) => h('th', cls ? { class: cls } : {}, text)))),
      h('tbody', {}, rows.length ? rows : h('tr', {}, h('td', { colspan: heads.length, class: 'muted' }, empty)))));
    const loadLists = async () => {
      const query = new URLSearchParams({ state: 'failed', limit: '100' });
      if (params.get('cursor')) query.set('cursor', params.get('cursor'));
      const [failed, waiting] = await Promise.all([
        fetchOk(`/v1/tenants/${enc(tenant)}/timers?${query}`),
        fetchOk(`/v1/tenants/${enc(tenant)}/timers?retrying=true&limit=100`),
      ]);
      const next = new URLSearchParams(params);
      if (failed.nextCursor) next.set('cursor', failed.nextCursor);
      const retryAll = h('button', {
        type: 'button', id: 'retry-all', disabled: failed.timers.length === 0,
        onclick: async () => {
          const c = await confirmAction(`Publish every failed timer of ${tenant} again?`, 'Each is Scheduled again at its own due time and fires at once, its attempts from 0.', 'Retry all');
          if (c.ok) await act('Retry all', 'POST', `/v1/tenants/${enc(tenant)}/timers/bulk`, { action: 'retry', filter: { state: 'failed' } });
        },
      }, 'Retry all');
      list.replaceChildren(h('div', { class: 'panel-head' }, h('h2', {}, 'Failed timers (every publish attempt failed)'), retryAll),
        table([['Timer'], ['Due (UTC)', 'hide-narrow'], ['Attempts', 'num'], ['Last error'], ['']],
          failed.timers.map((t) => troubleRow(t, t.dueAt, h('button', {
            type: 'button', class: 'small', 'data-retry': t.serviceCallId,
            onclick: async () => {
              const c = await confirmAction(`Publish ${t.serviceCallId} again?`, 'It is Scheduled again at its own due time, so it fires at once; its attempts start from 0.', 'Retry');
              if (c.ok) await act('Retry', 'POST', `${timerPath(t.tenantId, t.serviceCallId)}/retry`);
            },
          }, 'Retry'))),
          'No failed timers.'),
        ...(failed.nextCursor ? [h('div', { class: 'pager' }, h('a', { href: `#/failed?${next}` }, 'Next page'))] : []));
      retrying.replaceChildren(h('h2', {}, 'Publish failures being retried (Scheduled, waiting for the next attempt)'),
        table([['Timer'], ['Next attempt (UTC)', 'hide-narrow'], ['Attempts', 'num'], ['Last error'], ['']],
          waiting.timers.map((t) => troubleRow(t, t.nextAttemptAt, h('button', {
            type: 'button', class: 'small danger', 'data-cancel': t.serviceCallId,
            onclick: async () => {
              const c = await confirmAction(`Cancel ${t.serviceCallId}?`, t.recurrence ? 'The whole series ends; nothing more fires.' : 'It will not fire.', 'Cancel timer');
              if (c.ok) await act('Cancel', 'DELETE', timerPath(t.tenantId, t.serviceCallId));
            },
          }, 'Cancel'))),
          'None: no publish is failing.'),
        ...(waiting.nextCursor ? [h('p', { class: 'muted' }, 'The first 100 are shown.')] : []));
    };
    await loadLists();
  }
  const answer = await api.get('/v1/dead-letters');
  if (answer.status === 200) {
    const letters = answer.body.deadLetters;
    dead.replaceChildren(h('h2', {}, `Dead letters (${letters.length})`),
      letters.length ? h('ol', { class: 'timeline' }, letters.map((d) => h('li', {},
        h('div', { class: 'error' }, d.reason), h('pre', {}, d.body))))
        : h('p', { class: 'muted' }, 'None.'));
  } else {
    dead.replaceChildren(h('h2', {}, 'Dead letters'),
      h('p', { class: 'muted' }, answer.body.error ? answer.body.error.message : `answered ${answer.status}`));
  }
}
