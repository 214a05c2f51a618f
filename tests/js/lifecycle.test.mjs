// Listing, pause (with and without memory), auto-resume and a killed sandbox's command
// through the official JS SDK (issue 12: items 10, 11, 12 and 13).
import { test } from 'node:test'
import assert from 'node:assert/strict'
import { Sandbox, e2b, rest, stateOf, waitUntil } from './sdk.mjs'

// In the guest: a process whose survival (or not) across a pause is checked.
const HOLD = "python3 -c 'import time; open(\"/tmp/held\", \"w\").write(\"up\"); time.sleep(10**6)'"
const holding = async (sbx) => (await sbx.commands.run("pgrep -f 'time[.]sleep' || true")).stdout.trim() !== ''
// Once the held process has written its file (it may be seen running before it has).
const held = async (sbx) => (await sbx.commands.run('cat /tmp/held 2>/dev/null || true')).stdout === 'up'
const bootId = async (sbx) => (await sbx.commands.run('cat /proc/sys/kernel/random/boot_id')).stdout.trim()

async function pages(query, limit, order) {
  const paginator = Sandbox.list({ query, limit, order })
  const out = []
  while (paginator.hasNext) out.push((await paginator.nextItems()).map((s) => s.sandboxId))
  return out
}

test('listing pages newest first across running and paused, and filters (item 10)', async () => {
  const tag = { suite: 'js-listing' }
  const made = []
  try {
    for (let i = 0; i < 3; i++) made.push(await Sandbox.create('base', { metadata: tag, timeoutMs: 600_000 }))
    const [oldest, middle, newest] = made.map((s) => s.sandboxId)
    await made[1].pause()
    assert.deepEqual(await pages({ metadata: tag }, 1), [[newest], [middle], [oldest]])
    assert.deepEqual(await pages({ metadata: tag }, 2, 'asc'), [[oldest, middle], [newest]])
    assert.deepEqual(await pages({ metadata: tag, state: ['paused'] }, 10), [[middle]])
    assert.deepEqual(await pages({ metadata: tag, template: 'unknown-template' }, 10), [[]])
  } finally {
    for (const s of made) await s.kill()
  }
})

test('a background command whose sandbox is killed ends as E2B says (item 11)', async () => {
  const sbx = await Sandbox.create('base')
  const handle = await sbx.commands.run('sleep 600', { background: true })
  assert.equal(await Sandbox.kill(sbx.sandboxId), true)
  await assert.rejects(handle.wait(), /sandbox was killed or reached its end of life/)
})

test('a pause without memory keeps the files and boots on connect (item 12)', async () => {
  const sbx = await Sandbox.create('base', { timeoutMs: 600_000 })
  try {
    await sbx.files.write('/home/user/kept.txt', 'before the pause')
    await sbx.commands.run(HOLD, { background: true })
    await waitUntil(() => held(sbx), 'the held process to write its file')
    const booted = await bootId(sbx)
    assert.equal(await sbx.pause({ keepMemory: false }), true)
    assert.equal((await rest('GET', `/sandboxes/${sbx.sandboxId}`)).body.pauseMode, 'filesystem')
    const back = await Sandbox.connect(sbx.sandboxId, { timeoutMs: 600_000 })
    assert.equal(await back.files.read('/home/user/kept.txt'), 'before the pause')
    assert.notEqual(await bootId(back), booted)
    assert.equal(await holding(back), false, 'a process outlived the pause')

    // A full pause brought back with onResume: 'reboot'.
    await back.commands.run(HOLD, { background: true })
    await waitUntil(() => held(back), 'the held process to write its file again')
    await back.pause()
    assert.equal((await rest('GET', `/sandboxes/${sbx.sandboxId}`)).body.pauseMode, 'full')
    const rebooted = await Sandbox.connect(sbx.sandboxId, { onResume: 'reboot' })
    assert.equal(await rebooted.files.read('/home/user/kept.txt'), 'before the pause')
    assert.equal(await holding(rebooted), false, 'a process outlived the reboot')
  } finally {
    await Sandbox.kill(sbx.sandboxId)
  }
  // The timeout's auto-pause without memory.
  const timed = await Sandbox.create('base', { timeoutMs: 4_000, lifecycle: { onTimeout: { action: 'pause', keepMemory: false } } })
  try {
    await timed.files.write('/home/user/kept', 'after a disk-only auto-pause')
    // pauseMode shows once the pause has finished (E2B's word); "paused" shows from its start.
    const mode = async () => (await rest('GET', `/sandboxes/${timed.sandboxId}`)).body.pauseMode
    assert.equal(await waitUntil(mode, 'the 4 s timeout to pause it', 60_000), 'filesystem')
    const back = await Sandbox.connect(timed.sandboxId, { timeoutMs: 600_000 })
    assert.equal(await back.files.read('/home/user/kept'), 'after a disk-only auto-pause')
  } finally {
    await Sandbox.kill(timed.sandboxId)
  }
})

test('traffic resumes a paused sandbox that asked for it (item 13)', async () => {
  const sbx = await Sandbox.create('base', { timeoutMs: 600_000, lifecycle: { onTimeout: 'pause', autoResume: true } })
  try {
    await sbx.commands.run(HOLD, { background: true })
    await waitUntil(() => held(sbx), 'the held process to write its file')
    await sbx.pause()
    assert.equal(await stateOf(sbx.sandboxId), 'paused')
    assert.equal(await sbx.files.read('/tmp/held'), 'up')
    assert.equal(await stateOf(sbx.sandboxId), 'running')
    assert.equal(await holding(sbx), true, 'the process did not survive the pause')
  } finally {
    await sbx.kill()
  }
})

test('the SDK errors for unknown sandboxes', async () => {
  await assert.rejects(Sandbox.connect('inotthere0000000000000'), (e) => e instanceof e2b.NotFoundError || e instanceof e2b.SandboxNotFoundError)
})
