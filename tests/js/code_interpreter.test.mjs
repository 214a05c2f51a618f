// The official @e2b/code-interpreter JS SDK (issue 12: items 1 to 4).
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { interpreter } from './sdk.mjs'

const { Sandbox } = interpreter
let sbx
before(async () => {
  // Secure (the SDK's default) with a sandbox environment variable.
  sbx = await Sandbox.create({ timeoutMs: 600_000, envs: { FOO: 'bar' } })
})
after(async () => {
  await sbx?.kill()
})

test('the first cell is execution 1 and state persists (items 1 and 3)', async () => {
  const first = await sbx.runCode('x = 41')
  assert.equal(first.error, undefined)
  assert.equal(first.executionCount, 1)
  const next = await sbx.runCode('x + 1')
  assert.equal(next.text, '42')
})

test('sandbox and per-run envs reach python and bash (item 2)', async () => {
  assert.equal((await sbx.runCode("import os; os.getenv('FOO')")).text, 'bar')
  assert.equal((await sbx.runCode("os.getenv('RUN')", { envs: { RUN: 'once' } })).text, 'once')
  assert.equal((await sbx.runCode("os.getenv('RUN')")).text, undefined)
  const bash = await sbx.runCode('echo "$FOO $RUN"', { language: 'bash', envs: { RUN: 'here' } })
  assert.deepEqual(bash.logs.stdout, ['bar here\n'])
})

test('a DataFrame comes with its data and a dict as JSON (item 4)', async () => {
  const e = await sbx.runCode("import pandas as pd\npd.DataFrame({'a': [1, 2], 'when': pd.to_datetime(['2026-01-02', '2026-03-04 05:06'])})")
  assert.match(e.results[0].html, /<table/)
  assert.deepEqual(e.results[0].data, { a: [1, 2], when: ['2026-01-02T00:00:00', '2026-03-04T05:06:00'] })
  assert.deepEqual((await sbx.runCode("{'n': 1}")).results[0].json, { n: 1 })
})

test('output streams while the code runs', async () => {
  const lines = []
  const e = await sbx.runCode("import time\nfor i in range(3):\n    print(i, flush=True)\n    time.sleep(0.2)", { onStdout: (m) => lines.push(m.line) })
  assert.deepEqual(lines, ['0\n', '1\n', '2\n'])
  assert.equal(e.error, undefined)
})

test('JavaScript and TypeScript: ES modules, top-level await, types (item 5)', async () => {
  const hello = await sbx.runCode('console.log("Hello World!")', { language: 'js' })
  assert.deepEqual(hello.logs.stdout, ['Hello World!\n'])
  const esm = await sbx.runCode("import { readFileSync } from 'fs'\nconsole.log(typeof readFileSync)", { language: 'js' })
  assert.deepEqual(esm.logs.stdout, ['function\n'])
  assert.equal((await sbx.runCode("await Promise.resolve('Hello World!')", { language: 'js' })).text, 'Hello World!')
  assert.equal((await sbx.runCode('process.env.FOO', { language: 'js' })).text, 'bar')
  const ts = await sbx.runCode('const message: string = "Hello World!"; console.log(message)', { language: 'ts' })
  assert.deepEqual(ts.logs.stdout, ['Hello World!\n'])
  assert.equal((await sbx.runCode('process.cwd()', { language: 'ts' })).text, '/home/user')
})
