// The `lateness` workload of `timer-service bench`, run on pg-boss against the same PostgreSQL:
// TIMERS jobs (10,000) with `startAfter` spread evenly over SPREAD_MS (10 s) starting 2 s from
// now, one worker fetching up to BATCH jobs (500, as timer-service's engine.batch_size) every
// POLL_SECONDS (pg-boss default 2, its minimum 0.5); pg-boss waits the polling interval between
// fetches even after a full batch. Lateness = when the worker got the job - its startAfter.
// Prints one JSON line.
// Run through scripts/compare/pgboss.sh, which installs pg-boss and passes DATABASE_URL.
import PgBoss from 'pg-boss'

const url = process.env.DATABASE_URL
const n = Number(process.env.TIMERS || 10000)
const spread = Number(process.env.SPREAD_MS || 10000)
const poll = Number(process.env.POLL_SECONDS || 2)
const batch = Number(process.env.BATCH || 500)
const schema = `pgboss_bench_${Date.now()}`

const boss = new PgBoss({ connectionString: url, schema, max: 10 })
boss.on('error', (e) => console.error('pg-boss:', e.message))
await boss.start()
const queue = 'timers'
await boss.createQueue(queue)

const seen = new Set()
const lateness = []
let finish
const done = new Promise((resolve) => { finish = resolve })
await boss.work(queue, { pollingIntervalSeconds: poll, batchSize: batch }, async (jobs) => {
  const now = Date.now()
  for (const job of jobs) {
    if (!seen.has(job.data.i)) {
      seen.add(job.data.i)
      lateness.push(now - job.data.due)
    }
  }
  if (seen.size >= n) finish()
})

const start = Date.now() + 2000
const jobs = []
for (let i = 0; i < n; i++) {
  const due = start + Math.floor((i * spread) / n)
  jobs.push({ name: queue, data: { i, due }, startAfter: new Date(due).toISOString() })
}
for (let k = 0; k < jobs.length; k += 1000) await boss.insert(jobs.slice(k, k + 1000))
const giveUp = setTimeout(finish, spread + 60000)
await done
clearTimeout(giveUp)

lateness.sort((a, b) => a - b)
const at = (p) => lateness[Math.min(lateness.length - 1, Math.floor(p * lateness.length))]
console.log(JSON.stringify({
  peer: 'pg-boss 10.4.2', pollingIntervalSeconds: poll, batchSize: batch, timers: n,
  fired: seen.size,
  p50: at(0.5), p90: at(0.9), p99: at(0.99), max: lateness[lateness.length - 1]
}))
await boss.stop({ graceful: false, wait: true })
const { default: pg } = await import('pg')
const client = new pg.Client({ connectionString: url })
await client.connect()
await client.query(`DROP SCHEMA ${schema} CASCADE`)
await client.end()
