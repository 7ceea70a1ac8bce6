// The Next.js seed's client logic (`LeadForm.submit`), without React: one
// key per logical submission, created when the attempt begins, kept while
// the result is uncertain, dropped after acceptance or on a 409 ("this
// submission changed"). Shared by the page served at GET /lead (the browser
// test) and by lead-client.js (the client-contract test under Node).
'use strict'

function createLeadForm(formId, fetchImpl, base) {
  const activeKey = {current: null}
  async function submit(payload) {
    const idempotencyKey = activeKey.current ?? crypto.randomUUID()
    activeKey.current = idempotencyKey
    const response = await fetchImpl(`${base}/api/forms/${formId}/submit`, {
      method: 'POST',
      headers: {
        'Content-Type': 'application/json',
        'Idempotency-Key': idempotencyKey,
      },
      body: JSON.stringify(payload),
    })
    if (response.status === 409) {
      activeKey.current = null
      throw new Error('This submission changed while it was being retried.')
    }
    if (!response.ok) throw new Error('Submission failed')
    const receipt = await response.json()
    activeKey.current = null
    return receipt
  }
  return {submit, activeKey}
}

if (typeof module !== 'undefined') module.exports = {createLeadForm}
