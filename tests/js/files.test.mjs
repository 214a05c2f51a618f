// Files, commands and the base template through the official JS SDK (issue 12: items 6,
// 7, 8, 9, 14 and 15).
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { Sandbox, e2b, waitUntil } from './sdk.mjs'

let sbx
before(async () => {
  sbx = await Sandbox.create('base', { timeoutMs: 600_000, envs: { FOO: 'bar' } })
})
after(async () => {
  await sbx?.kill()
})

test('commands stream, see the sandbox envs and fail with their exit code', async () => {
  const out = []
  const r = await sbx.commands.run('echo $FOO; echo err >&2', { onStdout: (d) => out.push(d) })
  assert.equal(r.stdout, 'bar\n')
  assert.equal(r.stderr, 'err\n')
  assert.deepEqual(out.join(''), 'bar\n')
  await assert.rejects(sbx.commands.run('exit 3'), (e) => e instanceof e2b.CommandExitError && e.exitCode === 3)
})

test('the base template has what E2B base has (item 15)', async () => {
  const r = await sbx.commands.run('python --version && node --version && npm --version && jq --version && gcc --version | head -1')
  assert.match(r.stdout, /^Python 3\./)
  assert.match(r.stdout, /\nv\d+\./)
  assert.match(r.stdout, /jq-/)
})

test('a terminal gets its envs, answers, and takes a second client (issue 37, item 8)', async () => {
  // hutch's warm-up ran terminals in this sandbox's template and pool: they left no history.
  assert.equal((await sbx.commands.run('ls -A ~')).stdout.split('\n').includes('.bash_history'), false)
  const decoder = new TextDecoder()
  let first = ''
  let second = ''
  const terminal = await sbx.pty.create({ cols: 80, rows: 24, envs: { ABC: '123' }, onData: (d) => { first += decoder.decode(d) } })
  await sbx.pty.sendInput(terminal.pid, new TextEncoder().encode('echo $ABC-$FOO\n'))
  // E2B's own test gives this 300 ms; its time is in docs/BENCHMARKS.md, not here.
  await waitUntil(() => first.includes('123-bar\r\n'), 'the first client to see the echo')
  await terminal.disconnect()
  const again = await sbx.pty.connect(terminal.pid, { onData: (d) => { second += decoder.decode(d) } })
  await sbx.pty.sendInput(terminal.pid, new TextEncoder().encode('echo $ABC-$FOO\nexit\n'))
  await again.wait()
  assert.equal(again.pid, terminal.pid)
  assert.equal(again.exitCode, 0)
  assert.match(second, /123-bar\r\n/)
})

test('gzip uploads and downloads (item 6)', async () => {
  const text = 'squeezed '.repeat(1000)
  await sbx.files.write('/home/user/gz.txt', text, { gzip: true })
  assert.equal(await sbx.files.read('/home/user/gz.txt'), text)
  assert.equal(await sbx.files.read('/home/user/gz.txt', { gzip: true }), text)
})

test('file metadata in xattrs (item 7)', async () => {
  await sbx.files.write('/home/user/meta.txt', 'x', { metadata: { Author: 'mish', stage: 'draft' } })
  assert.deepEqual((await sbx.files.getInfo('/home/user/meta.txt')).metadata, { author: 'mish', stage: 'draft' })
  const listed = (await sbx.files.list('/home/user')).find((e) => e.name === 'meta.txt')
  assert.deepEqual(listed.metadata, { author: 'mish', stage: 'draft' })
  await sbx.files.rename('/home/user/meta.txt', '/home/user/moved.txt')
  assert.deepEqual((await sbx.files.getInfo('/home/user/moved.txt')).metadata, { author: 'mish', stage: 'draft' })
})

test('symlink info and writes into new directories (item 8)', async () => {
  await sbx.files.write('/home/user/test_file.txt', 'target')
  await sbx.commands.run('ln -sf test_file.txt /home/user/link.txt', { cwd: '/home/user' })
  const info = await sbx.files.getInfo('/home/user/link.txt')
  assert.equal(info.type, e2b.FileType.FILE)
  assert.equal(info.symlinkTarget, '/home/user/test_file.txt')
  await sbx.files.write([{ path: '/0/a.txt', data: 'new dir' }, { path: '/0/b/c.txt', data: 'deeper' }])
  assert.equal(await sbx.files.read('/0/b/c.txt'), 'deeper')
  assert.deepEqual((await sbx.commands.run('stat -c %U /0 /0/b /0/a.txt')).stdout.split(/\s+/).filter(Boolean), ['user', 'user', 'user'])
})

test('watch events come as envd reports them (item 9)', async () => {
  const T = e2b.FilesystemEventType
  await sbx.files.makeDir('watched')
  const seen = []
  const handle = await sbx.files.watchDir('watched', (e) => { seen.push([e.type, e.name]) })
  await sbx.files.write('watched/new.txt', 'first')
  await waitUntil(() => seen.length >= 3, 'three watch events')
  assert.deepEqual(seen.slice(0, 3), [[T.CREATE, 'new.txt'], [T.CHMOD, 'new.txt'], [T.WRITE, 'new.txt']])
  await handle.stop()

  await sbx.files.makeDir('tree/sub')
  const nested = []
  const recursive = await sbx.files.watchDir('tree', (e) => { nested.push([e.type, e.name]) }, { recursive: true })
  await sbx.files.write('tree/sub/file.txt', 'nested')
  await waitUntil(() => nested.length >= 3, 'three recursive watch events')
  assert.deepEqual(nested[0], [T.CREATE, 'sub/file.txt'])
  await recursive.stop()
})

test('signed URLs work through one sandbox URL (item 14)', async () => {
  const secure = await Sandbox.create('base', { timeoutMs: 300_000, secure: true })
  try {
    const up = await secure.uploadUrl('/home/user/signed.txt', { useSignatureExpiration: 120 })
    const form = new FormData()
    form.append('file', new Blob(['via a signed url']), 'signed.txt')
    assert.equal((await fetch(up, { method: 'POST', body: form })).status, 200)
    const down = await secure.downloadUrl('/home/user/signed.txt', { useSignatureExpiration: 120 })
    assert.equal(await (await fetch(down)).text(), 'via a signed url')
    const forged = new URL(down)
    forged.searchParams.set('signature', 'v1_' + 'A'.repeat(43))
    assert.equal((await fetch(forged)).status, 401)
  } finally {
    await secure.kill()
  }
})
