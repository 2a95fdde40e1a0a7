// End-to-end test of the chat page served by `pigeon serve` at `/`: two users in two browser
// contexts of headless Chromium exchange messages; one goes offline (network cut, then page
// closed) and comes back to see everything it missed, exactly once and in order.
// Run by e2e/run.sh, which starts the server and sets PIGEON_URL and PIGEON_ADMIN_KEY.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { chromium } from 'playwright-core';

const BASE = process.env.PIGEON_URL;
const KEY = process.env.PIGEON_ADMIN_KEY;
const CHROMIUM = process.env.CHROMIUM_PATH || '/usr/bin/chromium';
if (!BASE || !KEY) throw new Error('PIGEON_URL and PIGEON_ADMIN_KEY must be set (use e2e/run.sh)');

const A = 101;
const B = 202;
const C = 303;
const SINGLE = `${A}-${B}`;
const WAIT = 15000;

let browser;
const pageErrors = [];

before(async () => {
  browser = await chromium.launch({
    executablePath: CHROMIUM,
    headless: true,
    args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
      '--disable-background-networking', '--disable-component-update', '--disable-sync'],
  });
});

after(async () => {
  if (browser) await browser.close();
});

// Retries `fn` until it stops throwing, or throws its last error after `timeout` ms.
async function eventually(fn, timeout = WAIT) {
  const end = Date.now() + timeout;
  for (;;) {
    try {
      return await fn();
    } catch (e) {
      if (Date.now() > end) throw e;
      await new Promise((r) => setTimeout(r, 100));
    }
  }
}

function watch(page, who) {
  page.on('pageerror', (e) => pageErrors.push(`${who}: ${e.message}`));
  // HTTP errors the page expects and handles (a first login's 404 before registering, a chat
  // nobody wrote in yet answering 403 not_member) are logged by Chromium too; skip those.
  page.on('console', (m) => {
    if (m.type() === 'error' && !m.text().startsWith('Failed to load resource')) pageErrors.push(`${who} console: ${m.text()}`);
  });
}

async function login(page, uid) {
  await page.goto(BASE + '/');
  await page.fill('#login-user', String(uid));
  await page.fill('#login-key', KEY);
  await page.click('#login-btn');
  await page.waitForSelector('#app:not([hidden])', { timeout: WAIT });
  await connState(page, 'online');
}

async function connState(page, state) {
  await page.waitForSelector(`#conn-state[data-state="${state}"]`, { timeout: WAIT });
}

async function send(page, text) {
  await page.fill('#composer', text);
  await page.click('#send-btn');
}

// [seq, text] of every message shown in the open conversation.
function shown(page) {
  return page.$$eval('#messages .msg[data-seq]', (els) =>
    els.map((e) => [Number(e.dataset.seq), e.querySelector('.text').textContent]));
}

async function texts(page) {
  return (await shown(page)).map(([, t]) => t);
}

// Seqs the page's engine handed out for `conv`: each exactly once, ascending.
async function delivered(page, conv) {
  const list = await page.evaluate(() => window.pigeon.delivered);
  const seqs = list.filter((d) => d.startsWith(conv + ':')).map((d) => Number(d.slice(conv.length + 1)));
  for (let i = 1; i < seqs.length; i++) {
    assert.ok(seqs[i] > seqs[i - 1], `engine delivered ${conv} out of order or twice: ${seqs.join(',')}`);
  }
  return seqs;
}

function assertInOrder(list) {
  const seqs = list.map(([s]) => s);
  for (let i = 1; i < seqs.length; i++) assert.equal(seqs[i], seqs[i - 1] + 1, `seqs not contiguous: ${seqs.join(',')}`);
}

async function unreadOf(page, conv) {
  return Number(await page.getAttribute(`#conv-list li[data-conv="${conv}"]`, 'data-unread'));
}

async function adminToken(uid) {
  const h = { Authorization: `Bearer ${KEY}`, 'content-type': 'application/json' };
  let r = await fetch(`${BASE}/v1/admin/users`, { method: 'POST', headers: h, body: JSON.stringify({ user_id: uid, name: `user ${uid}` }) });
  assert.equal(r.status, 200);
  r = await fetch(`${BASE}/v1/admin/tokens`, { method: 'POST', headers: h, body: JSON.stringify({ user_id: uid }) });
  assert.equal(r.status, 200);
  return (await r.json()).token;
}

test('two users chat; one goes offline and catches up exactly once, in order', async (t) => {
  const ctxA = await browser.newContext();
  const ctxB = await browser.newContext();
  try {
    const pa = await ctxA.newPage();
    let pb = await ctxB.newPage();
    watch(pa, 'A');
    watch(pb, 'B');
    await login(pa, A);
    await login(pb, B);

    await t.test('A opens a chat with B and sends; B sees it with an unread count', async () => {
      await pa.fill('#open-user', String(B));
      await pa.click('#open-btn');
      await pa.waitForSelector(`#chat-title[data-conv="${SINGLE}"]`);
      await send(pa, 'hello 1');
      await send(pa, 'hello 2');
      await eventually(async () => assert.deepEqual(await texts(pa), ['hello 1', 'hello 2']));
      await pb.waitForSelector(`#conv-list li[data-conv="${SINGLE}"]`, { timeout: WAIT });
      await eventually(async () => assert.equal(await unreadOf(pb, SINGLE), 2));
      assert.equal(await pb.textContent(`#conv-list li[data-conv="${SINGLE}"] .unread`), '2');
      await pb.click(`#conv-list li[data-conv="${SINGLE}"]`);
      await eventually(async () => assert.deepEqual(await shown(pb), [[1, 'hello 1'], [2, 'hello 2']]));
      assert.equal(await unreadOf(pb, SINGLE), 0);
    });

    await t.test('live delivery and read receipts', async () => {
      await send(pa, 'live 3');
      await eventually(async () => assert.deepEqual(await texts(pb), ['hello 1', 'hello 2', 'live 3']));
      // B has the chat open, so it marks it read; A sees the receipt on its messages.
      await eventually(async () => assert.equal(await pa.textContent('#messages .msg[data-seq="3"] .receipt'), 'read'));
    });

    await t.test('B loses the network, A sends, B comes back and catches up', async () => {
      await ctxB.setOffline(true);
      await connState(pb, 'offline');
      await send(pa, 'offline 4');
      await send(pa, 'offline 5');
      await send(pa, 'offline 6');
      await eventually(async () => assert.equal((await shown(pa)).length, 6));
      await pb.waitForTimeout(500);
      assert.deepEqual(await texts(pb), ['hello 1', 'hello 2', 'live 3'], 'B is offline and must not get pushes');
      await ctxB.setOffline(false);
      await connState(pb, 'online');
      const want = ['hello 1', 'hello 2', 'live 3', 'offline 4', 'offline 5', 'offline 6'];
      await eventually(async () => assert.deepEqual(await texts(pb), want));
      assertInOrder(await shown(pb));
      assert.deepEqual(await delivered(pb, SINGLE), [1, 2, 3, 4, 5, 6]);
      // B read them: A's newest message says so.
      await eventually(async () => assert.equal(await pa.textContent('#messages .msg[data-seq="6"] .receipt'), 'read'));
    });

    await t.test('B closes the page, A sends, B reopens, logs in again and sees what it missed', async () => {
      await pb.waitForTimeout(700); // let B's batched acks go out (500 ms)
      await pb.close();
      await send(pa, 'closed 7');
      await send(pa, 'closed 8');
      await eventually(async () => assert.equal((await shown(pa)).length, 8));
      pb = await ctxB.newPage();
      watch(pb, 'B2');
      await login(pb, B);
      await eventually(async () => assert.equal(await unreadOf(pb, SINGLE), 2));
      // The same device (its id is kept in localStorage) resumes where it stopped: only the
      // messages it missed come through the catch-up.
      await eventually(async () => assert.deepEqual(await delivered(pb, SINGLE), [7, 8]));
      await pb.click(`#conv-list li[data-conv="${SINGLE}"]`);
      const want = ['hello 1', 'hello 2', 'live 3', 'offline 4', 'offline 5', 'offline 6', 'closed 7', 'closed 8'];
      await eventually(async () => assert.deepEqual(await texts(pb), want));
      assertInOrder(await shown(pb));
      await eventually(async () => assert.equal(await unreadOf(pb, SINGLE), 0));
    });

    await t.test('B replies and A sees it live', async () => {
      await send(pb, 'reply 9');
      await eventually(async () => assert.deepEqual((await texts(pa)).slice(-1), ['reply 9']));
      await eventually(async () => assert.deepEqual((await texts(pb)).slice(-1), ['reply 9']));
      assertInOrder(await shown(pa));
    });

    await t.test('A recalls a message; B sees it recalled', async () => {
      await pa.click('#messages .msg[data-seq="2"] .recall');
      await eventually(async () => assert.equal(await pa.getAttribute('#messages .msg[data-seq="2"]', 'data-status'), 'recalled'));
      await eventually(async () => assert.equal(await pb.getAttribute('#messages .msg[data-seq="2"]', 'data-status'), 'recalled'));
      assert.equal(await pb.textContent('#messages .msg[data-seq="2"] .text'), 'message recalled');
      await pb.waitForSelector('#messages .sys[data-kind="recall"]', { timeout: WAIT });
      // Every other message is untouched and still there once.
      assert.deepEqual(await texts(pb), ['hello 1', 'message recalled', 'live 3', 'offline 4', 'offline 5', 'offline 6',
        'closed 7', 'closed 8', 'reply 9']);
    });

    await t.test('A creates a group with B; it appears for B and messages flow', async () => {
      await pa.fill('#group-name', 'e2e group');
      await pa.fill('#group-members', String(B));
      await pa.click('#group-btn');
      await pa.waitForSelector('#chat-title[data-conv^="g"]', { timeout: WAIT });
      const gid = await pa.getAttribute('#chat-title', 'data-conv');
      await pb.waitForSelector(`#conv-list li[data-conv="${gid}"]`, { timeout: WAIT });
      await pb.click(`#conv-list li[data-conv="${gid}"]`);
      await pb.waitForSelector('#messages .sys[data-kind="group_created"]', { timeout: WAIT });
      await send(pa, 'hi group');
      await eventually(async () => assert.deepEqual(await texts(pb), ['hi group']));
      await eventually(async () => assert.equal(await pa.textContent('#messages .msg:last-child .receipt'), 'read by 1'));
    });
  } finally {
    await ctxA.close();
    await ctxB.close();
  }
  assert.deepEqual(pageErrors, []);
});

test('history pages back with the older button', async () => {
  // 45 messages from A to C over HTTP, then C opens the chat: 30 shown, 15 more on "older".
  const token = await adminToken(A);
  await adminToken(C);
  for (let i = 1; i <= 45; i++) {
    const r = await fetch(`${BASE}/v1/messages`, {
      method: 'POST',
      headers: { Authorization: `Bearer ${token}`, 'content-type': 'application/json' },
      body: JSON.stringify({ client_msg_id: `hist-${i}`, to: { user: C }, kind: 'text', content: `m${i}` }),
    });
    assert.equal(r.status, 200);
  }
  const ctx = await browser.newContext();
  try {
    const pc = await ctx.newPage();
    watch(pc, 'C');
    await login(pc, C);
    const conv = `${A}-${C}`;
    await eventually(async () => assert.equal(await unreadOf(pc, conv), 45));
    await pc.click(`#conv-list li[data-conv="${conv}"]`);
    await eventually(async () => assert.equal((await shown(pc)).length, 30));
    assert.deepEqual((await shown(pc))[0], [16, 'm16']);
    await pc.click('#older-btn');
    await eventually(async () => assert.equal((await shown(pc)).length, 45));
    const all = await shown(pc);
    assertInOrder(all);
    assert.deepEqual(all[0], [1, 'm1']);
    assert.equal(await pc.$('#older-btn'), null);
  } finally {
    await ctx.close();
  }
  assert.deepEqual(pageErrors, []);
});

test('a lost push is pulled and a doubled one dropped (token login)', async () => {
  // E's socket goes through a proxy in the test that drops the first push of "dropped" and
  // sends "doubled" twice: the page must buffer past the hole, pull it, and drop the copy.
  const E = 505;
  const tokenA = await adminToken(A);
  const tokenE = await adminToken(E);
  const toServer = [];
  let droppedOnce = false;
  const ctx = await browser.newContext();
  try {
    await ctx.routeWebSocket(/\/v1\/ws/, (ws) => {
      const server = ws.connectToServer();
      ws.onMessage((m) => { try { toServer.push(JSON.parse(m)); } catch { /* not JSON */ } server.send(m); });
      server.onMessage((m) => {
        let f = null;
        try { f = JSON.parse(m); } catch { /* not JSON */ }
        const content = f && f.type === 'msg' ? f.message.content : null;
        if (content === 'dropped' && !droppedOnce) { droppedOnce = true; return; }
        ws.send(m);
        if (content === 'doubled') ws.send(m);
      });
    });
    const pe = await ctx.newPage();
    watch(pe, 'E');
    await pe.goto(BASE + '/');
    await pe.fill('#login-token', tokenE);
    await pe.click('#login-btn');
    await connState(pe, 'online');
    await pe.waitForSelector(`#me[data-user="${E}"]`, { timeout: WAIT });
    await pe.fill('#open-user', String(A));
    await pe.click('#open-btn');
    const conv = `${A}-${E}`;
    await pe.waitForSelector(`#chat-title[data-conv="${conv}"]`);
    const want = ['one', 'dropped', 'three', 'doubled', 'five'];
    for (const [i, content] of want.entries()) {
      const r = await fetch(`${BASE}/v1/messages`, {
        method: 'POST',
        headers: { Authorization: `Bearer ${tokenA}`, 'content-type': 'application/json' },
        body: JSON.stringify({ client_msg_id: `lossy-${i}`, to: { user: E }, kind: 'text', content }),
      });
      assert.equal(r.status, 200);
    }
    await eventually(async () => assert.deepEqual(await texts(pe), want));
    assertInOrder(await shown(pe));
    assert.deepEqual(await delivered(pe, conv), [1, 2, 3, 4, 5]);
    assert.ok(droppedOnce, 'the proxy dropped a push');
    const pulls = toServer.filter((f) => f.type === 'pull' && f.chain === 'user');
    assert.ok(pulls.some((f) => f.from === 2 && f.to === 2), `the hole was pulled: ${JSON.stringify(pulls)}`);
    await eventually(async () => {
      const acks = toServer.filter((f) => f.type === 'ack' && typeof f.user_seq === 'number');
      assert.equal(acks.at(-1)?.user_seq, 5, 'acknowledged up to the newest');
    });
  } finally {
    await ctx.close();
  }
  assert.deepEqual(pageErrors, []);
});

test('a revoked token sends the page back to the login form', async () => {
  const F = 606;
  const ctx = await browser.newContext();
  try {
    const pf = await ctx.newPage();
    watch(pf, 'F');
    await login(pf, F);
    const r = await fetch(`${BASE}/v1/admin/users/${F}/logout`, { method: 'POST', headers: { Authorization: `Bearer ${KEY}` } });
    assert.equal(r.status, 200);
    await pf.waitForSelector('#login:not([hidden])', { timeout: WAIT });
    assert.match(await pf.textContent('#login-error'), /token_revoked/);
    await connState(pf, 'offline');
  } finally {
    await ctx.close();
  }
  assert.deepEqual(pageErrors, []);
});

test('a read fan-out group: live pushes, then catch-up by conversation seq after going offline', async () => {
  // run.sh starts the server with --fanout-write-max-members 2: this group of three is read
  // fan-out, its messages reach members by the group's own seq, not their inboxes.
  const G1 = 707;
  const G2 = 808;
  const G3 = 909;
  const c1 = await browser.newContext();
  const c2 = await browser.newContext();
  try {
    const p1 = await c1.newPage();
    const p2 = await c2.newPage();
    watch(p1, 'G1');
    watch(p2, 'G2');
    await login(p1, G1);
    await login(p2, G2);
    await adminToken(G3);
    await p1.fill('#group-name', 'big group');
    await p1.fill('#group-members', `${G2}, ${G3}`);
    await p1.click('#group-btn');
    await p1.waitForSelector('#chat-title[data-conv^="g"]', { timeout: WAIT });
    const gid = await p1.getAttribute('#chat-title', 'data-conv');
    await p2.waitForSelector(`#conv-list li[data-conv="${gid}"]`, { timeout: WAIT });
    await p2.click(`#conv-list li[data-conv="${gid}"]`);
    assert.equal(await p2.evaluate((g) => window.pigeon.convById.get(g).fanout, gid), 'read');
    await send(p1, 'r1');
    await eventually(async () => assert.deepEqual(await texts(p2), ['r1']));
    await eventually(async () => assert.equal(await p1.textContent('#messages .msg:last-child .receipt'), 'read by 1'));

    await c2.setOffline(true);
    await connState(p2, 'offline');
    await send(p1, 'r2');
    await send(p1, 'r3');
    await eventually(async () => assert.deepEqual(await texts(p1), ['r1', 'r2', 'r3']));
    await c2.setOffline(false);
    await connState(p2, 'online');
    // Nothing new is pushed after the reconnect: only sync (the group's seq moved past the
    // page's position) can bring these.
    await eventually(async () => assert.deepEqual(await texts(p2), ['r1', 'r2', 'r3']));

    // A send while offline waits in the page and goes out when the socket is back.
    await c2.setOffline(true);
    await connState(p2, 'offline');
    await send(p2, 'queued');
    await p2.waitForSelector('#messages .msg.pending', { timeout: WAIT });
    await c2.setOffline(false);
    await connState(p2, 'online');
    const want = ['r1', 'r2', 'r3', 'queued'];
    await eventually(async () => assert.deepEqual(await texts(p2), want));
    await eventually(async () => assert.deepEqual(await texts(p1), want));
    assert.equal(await p2.$('#messages .msg.pending'), null);
    assertInOrder(await shown(p1));
    assertInOrder(await shown(p2));
    const seqs = await delivered(p2, gid);
    assert.deepEqual(seqs, Array.from({ length: seqs.length }, (_, i) => i + 1), `group seqs ${seqs}`);
    assert.ok(seqs.length >= 5, `group_created and four messages: ${seqs}`);
  } finally {
    await c1.close();
    await c2.close();
  }
  assert.deepEqual(pageErrors, []);
});
