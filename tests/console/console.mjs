// Drives the relay console in headless Chromium against a running relay:
// a dead intent is visible, Replay (confirmed) makes it succeed, and the
// counts on the page update; an uncertain intent is resolved as succeeded
// (with a note); one dead outbox row is replayed and another skipped. Run by
// tests/e2e/admin.rs, which sets CONSOLE_URL, CONSOLE_TOKEN, INTENT_ID,
// UNCERTAIN_ID, OUTBOX_REPLAY_ID and OUTBOX_SKIP_ID; exits non-zero on failure.
import { chromium } from "playwright-core";

const url = process.env.CONSOLE_URL;
const token = process.env.CONSOLE_TOKEN;
const intentId = process.env.INTENT_ID;
const uncertainId = process.env.UNCERTAIN_ID;
const outboxReplayId = process.env.OUTBOX_REPLAY_ID;
const outboxSkipId = process.env.OUTBOX_SKIP_ID;
const holdHeadId = process.env.HOLD_HEAD_ID;
const heldId = process.env.HELD_ID;
const cutShortId = process.env.CUT_SHORT_ID;
const shot = process.env.SCREENSHOT || "/tmp/relay-console.png";
if (!url || !token || !intentId || !uncertainId || !outboxReplayId || !outboxSkipId) {
  throw new Error("CONSOLE_URL, CONSOLE_TOKEN, INTENT_ID, UNCERTAIN_ID, OUTBOX_REPLAY_ID and OUTBOX_SKIP_ID are required");
}

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"],
});
let failed = false;
try {
  const page = await browser.newPage();
  const confirms = [];
  page.on("dialog", async (d) => {
    confirms.push(d.message());
    await (d.type() === "prompt" ? d.accept("PSP dashboard: captured") : d.accept());
  });
  page.on("pageerror", (e) => { console.error("page error:", e.message); failed = true; });
  await page.goto(url);
  await page.fill("#token", token);
  await page.click("#connect");

  // The dead intent is listed, with its error, and counted.
  const row = page.locator(`#dead-intents tbody tr[data-id="${intentId}"]`);
  await row.waitFor({ timeout: 20000 });
  // Listed with the uncertain one.
  await page.waitForFunction(() => document.querySelector("#dead-intent-count").textContent === "2", null, { timeout: 20000 });
  const error = await row.locator("td.error-text").textContent();
  if (!error.includes("422")) throw new Error(`the dead intent's error should show the 422, got: ${error}`);
  const deadBefore = await page.locator('#intent-counts dd[data-key="dead"]').textContent();
  if (deadBefore !== "1") throw new Error(`dead count should be 1, got ${deadBefore}`);

  // Its attempt timeline shows the permanent failure.
  await row.getByRole("button", { name: "Attempts" }).click();
  await page.locator("#timeline-list li.outcome-permanent").first().waitFor({ timeout: 10000 });

  // Replay, confirmed: the intent succeeds and the counts update.
  await row.getByRole("button", { name: "Replay" }).click();
  if (!confirms.some((m) => m.includes(intentId))) throw new Error(`no confirmation naming the intent: ${confirms}`);
  await row.waitFor({ state: "detached", timeout: 30000 });
  await page.waitForFunction(() => document.querySelector("#dead-intent-count").textContent === "1", null, { timeout: 30000 });
  await page.waitForFunction(
    () => document.querySelector('#intent-counts dd[data-key="succeeded"]').textContent === "1"
       && document.querySelector('#intent-counts dd[data-key="dead"]').textContent === "0",
    null, { timeout: 30000 });

  // The uncertain intent offers Resolve; resolved as succeeded (the prompt
  // names the effects and takes the note), it leaves the list.
  const uncertain = page.locator(`#dead-intents tbody tr[data-id="${uncertainId}"]`);
  await uncertain.waitFor({ timeout: 20000 });
  await uncertain.getByRole("button", { name: "Resolve succeeded" }).click();
  if (!confirms.some((m) => m.includes(uncertainId) && m.includes("on_success"))) {
    throw new Error(`no prompt naming the intent and its on_success effects: ${confirms}`);
  }
  await uncertain.waitFor({ state: "detached", timeout: 30000 });
  await page.waitForFunction(
    () => document.querySelector('#intent-counts dd[data-key="succeeded"]').textContent === "2", null, { timeout: 30000 });

  // Dead outbox rows: one replayed, one skipped, each confirmed.
  await page.waitForFunction(() => document.querySelector("#dead-outbox-count").textContent === "2", null, { timeout: 20000 });
  const replayRow = page.locator(`#dead-outbox tbody tr[data-id="${outboxReplayId}"]`);
  await replayRow.getByRole("button", { name: "Replay" }).click();
  if (!confirms.some((m) => m.includes(outboxReplayId))) throw new Error(`no confirmation naming the row: ${confirms}`);
  await replayRow.waitFor({ state: "detached", timeout: 30000 });
  const skipRow = page.locator(`#dead-outbox tbody tr[data-id="${outboxSkipId}"]`);
  await skipRow.getByRole("button", { name: "Skip" }).click();
  if (!confirms.some((m) => m.includes(outboxSkipId) && m.includes("Never publish"))) {
    throw new Error(`no confirmation naming the skipped row: ${confirms}`);
  }
  await page.waitForFunction(() => document.querySelector("#dead-outbox-count").textContent === "0", null, { timeout: 30000 });

  // A dead letter holding its key offers Skip; the record held behind it
  // offers nothing (it goes when its head does). Skipped, both leave the list.
  const headRow = page.locator(`#dead-letters tbody tr[data-id="${holdHeadId}"]`);
  const heldRow = page.locator(`#dead-letters tbody tr[data-id="${heldId}"]`);
  await heldRow.waitFor({ timeout: 20000 });
  if (!(await headRow.textContent()).includes("holds its key")) throw new Error("the head is not shown holding its key");
  if ((await heldRow.getByRole("button").count()) !== 0) throw new Error("a held record offers actions of its own");
  const cutShortRow = page.locator(`#dead-letters tbody tr[data-id="${cutShortId}"]`);
  await cutShortRow.waitFor({ timeout: 20000 });
  if (!(await cutShortRow.textContent()).includes("release cut short")) {
    throw new Error("a head whose release was cut short is not shown as such");
  }
  await page.waitForFunction(
    () => document.querySelector('#dl-counts dd[data-key="records held"]').textContent === "1", null, { timeout: 20000 });
  await headRow.getByRole("button", { name: "Skip" }).click();
  if (!confirms.some((m) => m.includes(`Skip dead letter ${holdHeadId}`))) throw new Error(`no confirmation naming the dead letter: ${confirms}`);
  await heldRow.waitFor({ state: "detached", timeout: 30000 });
  await headRow.waitFor({ state: "detached", timeout: 30000 });
  await page.screenshot({ path: shot, fullPage: true });
  console.log(`console: dead intent replayed, uncertain one resolved, dead outbox rows replayed and skipped, held key released (screenshot ${shot})`);
} catch (e) {
  failed = true;
  console.error("console test failed:", e.message);
} finally {
  await browser.close();
}
process.exit(failed ? 1 : 0);
