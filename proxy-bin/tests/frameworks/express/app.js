// The Next.js seed's submission API as a real Express app, for the proxy's
// tests. It has NO idempotency of its own (no key table, no unique
// constraint): behind idempotency-proxy, the proxy alone must make each
// submission take effect once. It answers the way the seed's route does:
// 400 without a UUID key, 404 for an unknown form, 422 with the validation
// issues, 202 with a receipt on acceptance.
//
// Run: node app.js PORT (SUBMIT_DELAY_MS: how long an accepted submission
// takes, default 20).  GET /_stats answers the counts (tests only).
'use strict'

const crypto = require('node:crypto')
const express = require('express')

const port = Number(process.argv[2] || 3000)
// Each accepted submission takes this long, so concurrent duplicates overlap.
const delayMs = Number(process.env.SUBMIT_DELAY_MS || 20)
// `broken`: a form whose submission commits and whose answer then breaks
// off after its head, as a process restarted mid-response leaves it.
const forms = new Set(['contact', 'newsletter', 'broken'])
const submissions = []
const events = []

const app = express()
app.use(express.json({limit: '1mb'}))

const UUID = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i

app.post('/api/forms/:formId/submit', async (req, res) => {
  const key = req.get('Idempotency-Key')
  if (!key || !UUID.test(key)) {
    return res.status(400).json({error: 'A valid Idempotency-Key header is required'})
  }
  if (!forms.has(req.params.formId)) return res.status(404).send('Not found')
  const payload = req.body || {}
  const issues = []
  if (typeof payload.email !== 'string' || !payload.email.includes('@')) {
    issues.push({path: ['email'], message: 'Invalid email'})
  }
  if (typeof payload.name !== 'string' || payload.name.length === 0) {
    issues.push({path: ['name'], message: 'Required'})
  }
  if (issues.length > 0) return res.status(422).json({issues})
  await new Promise((resolve) => setTimeout(resolve, delayMs))
  const submissionId = crypto.randomUUID()
  submissions.push({submissionId, formId: req.params.formId, key, payload})
  events.push({submissionId, type: 'submission.accepted'})
  if (req.params.formId === 'broken') {
    res.writeHead(202, {'Content-Type': 'application/json', 'Content-Length': '100'})
    res.write('{"submissionId":')
    return setTimeout(() => res.socket.destroy(), 20)
  }
  return res.status(202).json({submissionId, status: 'accepted', replayed: false})
})

// The seed's lead form in a page: the browser test double-clicks its button.
app.get('/lead', (req, res) => {
  res.type('html').send(`<!doctype html><html><head><title>Lead</title></head><body>
<form id="lead"><input id="email" name="email"><input id="name" name="name">
<button id="send" type="submit">Send</button></form><p id="result"></p>
<script src="/lead-form.js"></script>
<script>
  const form = createLeadForm('contact', fetch.bind(window), '')
  document.getElementById('lead').addEventListener('submit', async (event) => {
    event.preventDefault()
    const payload = {
      email: document.getElementById('email').value,
      name: document.getElementById('name').value,
    }
    const result = document.getElementById('result')
    try {
      const receipt = await form.submit(payload)
      result.textContent = 'accepted ' + receipt.submissionId
    } catch (error) {
      result.textContent = 'error ' + error.message
    }
  })
</script></body></html>`)
})

app.get('/lead-form.js', (req, res) => {
  res.type('application/javascript').sendFile(require('node:path').join(__dirname, 'lead-form.js'))
})

app.get('/_stats', (req, res) => {
  const byKey = {}
  for (const s of submissions) byKey[s.key] = (byKey[s.key] || 0) + 1
  res.json({submissions: submissions.length, events: events.length, byKey})
})

app.listen(port, '127.0.0.1', () => console.log(`listening on ${port}`))
