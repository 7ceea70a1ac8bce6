// The seed's client against the proxy, in Node:
// `node lead-client.js BASE [PAUSE_MS] [FORM]`.
//
// Scenario: the first attempt's answer is lost (the client gives up after
// 300 ms; the server goes on), so the result is uncertain and the client
// keeps its key. The user clicks again at once: the proxy finds the first
// attempt still in flight. Once the first attempt has finished, the user
// clicks a third time. Prints one JSON line (what each click got and the
// keys used) for the Rust test to check.
'use strict'

const {createLeadForm} = require('./lead-form.js')

async function main() {
  const base = process.argv[2]
  let calls = 0
  // The first request is abandoned after 300 ms (time for a loaded
  // machine to have sent it), as a phone that loses
  // its network would; the others wait for their answers.
  const flakyFetch = (url, init) => {
    calls += 1
    if (calls === 1) {
      const controller = new AbortController()
      setTimeout(() => controller.abort(), 300)
      return fetch(url, {...init, signal: controller.signal})
    }
    return fetch(url, init)
  }
  const form = createLeadForm(process.argv[4] || 'contact', flakyFetch, base)
  const payload = {email: 'ada@example.com', name: 'Ada'}
  const click = async () => {
    try {
      return {ok: true, receipt: await form.submit(payload), key: form.activeKey.current}
    } catch (error) {
      return {ok: false, error: error.message, key: form.activeKey.current}
    }
  }
  const first = await click()
  const keptKey = form.activeKey.current
  const second = await click()
  await new Promise((resolve) => setTimeout(resolve, Number(process.argv[3] || 1500)))
  const third = await click()
  console.log(JSON.stringify({first, keptKey, second, third}))
}

main().catch((error) => {
  console.error(error)
  process.exit(1)
})
