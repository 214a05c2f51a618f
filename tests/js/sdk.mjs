// The official JS SDKs (e2b, @e2b/code-interpreter) from npm, unchanged, loaded from the
// pinned install under $HUTCH_HOME (HUTCH_JS_SDK, made by scripts/python-tests.sh).
// Only E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY point them at hutch serve.
import { pathToFileURL } from 'node:url'
import path from 'node:path'

const base = process.env.HUTCH_JS_SDK
if (!base) throw new Error('HUTCH_JS_SDK is not set: run these through tests/e2b/test_official_js_sdk.py')
const load = (pkg) => import(pathToFileURL(path.join(base, 'node_modules', pkg, 'dist', 'index.mjs')).href)

export const e2b = await load('e2b')
export const interpreter = await load('@e2b/code-interpreter')
export const { Sandbox } = e2b

export const apiUrl = process.env.E2B_API_URL
export const apiKey = process.env.E2B_API_KEY

/** The control plane's REST API, for what the SDK does not show (pauseMode). */
export async function rest(method, route, body) {
  const r = await fetch(apiUrl + route, {
    method,
    headers: { 'X-API-Key': apiKey, 'Content-Type': 'application/json' },
    body: body === undefined ? undefined : JSON.stringify(body),
    signal: AbortSignal.timeout(300_000),
  })
  const text = await r.text()
  return { status: r.status, body: text ? JSON.parse(text) : null }
}

/** Polls `predicate` until it is truthy (then returns it) or `ms` pass. */
export async function waitUntil(predicate, what, ms = 30_000) {
  const deadline = Date.now() + ms
  for (;;) {
    const value = await predicate()
    if (value) return value
    if (Date.now() > deadline) throw new Error(`timed out after ${ms} ms waiting for ${what}`)
    await new Promise((resolve) => setTimeout(resolve, 100)) // the poll interval of this bounded wait
  }
}

export async function stateOf(id) {
  return (await rest('GET', `/sandboxes/${id}`)).body.state
}
