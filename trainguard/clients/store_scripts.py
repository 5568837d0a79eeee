"""The state store's key names and its atomic Lua scripts (``trainguard.clients.store.StateStore`` runs
them; each key family's module has its keys' table). Pure data and string functions: nothing here
talks to Valkey."""
from __future__ import annotations

import dataclasses
from typing import Any

from trainguard.schemas import JobSettings

__all__ = ["TAKE_CLAIM", "idem_key", "job_key", "outbox_key", "audit_key", "rep_key", "members_key", "settings_fields", "GENERATION_ENDED", "BEGIN_RUN", "ADD_MEMBERS", "ADD_SPARE", "END_RUN", "BUMP_GENERATION", "ADD_OFFENCE", "OUTBOX_INDEX", "OUTBOX_DONE"]


#: ``StateStore.take_claim``: set KEYS[1] to ARGV[2] only while it holds ARGV[1], keeping its TTL
TAKE_CLAIM = ("if redis.call('get', KEYS[1]) == ARGV[1] then "
               "redis.call('set', KEYS[1], ARGV[2], 'KEEPTTL') return 1 else return 0 end")


def idem_key(key: str) -> str:
    return f"tg:idem:{key}"


def job_key(job: str) -> str:
    return f"tg:job:{job}"


def outbox_key(job: str) -> str:
    """The remediator's outbox of ``job``: outside ``tg:job:*``, which workers may write (a
    decision a worker put there was published by the remediator's sweep as its own)."""
    return f"tg:outbox:{job}"


def audit_key(job: str) -> str:
    """The audit trail of ``job``: outside ``tg:job:*``, which workers may write (a worker
    could delete or append to it there)."""
    return f"tg:audit:{job}"


#: The set of jobs whose outbox holds a decision (``outbox_key``): the remediator's sweep reads
#: it instead of every job's outbox (at 1,250 jobs one sweep parsed 1,250 replies every 2 s).
OUTBOX_INDEX = "tg:outboxes"

# KEYS[1] = a job's outbox, KEYS[2] = OUTBOX_INDEX; ARGV = decision id, job. The job leaves
# the index with its last decision, atomically (a put in between keeps it there).
OUTBOX_DONE = """
redis.call('HDEL', KEYS[1], ARGV[1])
if redis.call('HLEN', KEYS[1]) == 0 then redis.call('SREM', KEYS[2], ARGV[2]) end
return 0
"""


def rep_key(node: str) -> str:
    return f"tg:rep:{node}"


def members_key(service: str) -> str:
    return f"tg:members:{service}"


def settings_fields(settings: JobSettings) -> dict[str, Any]:
    return {f.name: getattr(settings, f.name) for f in dataclasses.fields(JobSettings)}


# KEYS[1] = job hash, KEYS[2] = launcher leases; ARGV = node, now (ms), lease (ms),
# settings to set (JSON map of encoded values), settings to delete (JSON list)
# Records ``generation_ends[<gen>] = <now ns>`` (ARGV[n], text) for the generation moved past,
# keeping the last 64: the fence of checkpoints a generation wrote after its end.
GENERATION_ENDED = """
local function ended(g, now)
  local ends = cjson.decode(redis.call('HGET', KEYS[1], 'generation_ends') or '{}')
  if ends[tostring(g)] == nil then ends[tostring(g)] = now end
  local keep = {}
  for k, v in pairs(ends) do
    if tonumber(k) > g - 64 then keep[k] = v end
  end
  redis.call('HSET', KEYS[1], 'generation_ends', cjson.encode(keep))
end
"""

BEGIN_RUN = GENERATION_ENDED + """
local now, lease, run_id = tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[6]
if run_id ~= '' and (redis.call('HGET', KEYS[1], 'run_id') or '') ~= run_id then
    redis.call('DEL', KEYS[2])
    redis.call('HSET', KEYS[1], 'run_id', run_id)
end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local mine = redis.call('ZSCORE', KEYS[2], ARGV[1])
if mine then
    return {-1, -1, tonumber(mine) - now}
end
local live = redis.call('ZCARD', KEYS[2])
local runs = tonumber(redis.call('HGET', KEYS[1], 'runs') or '0')
local gen = tonumber(redis.call('HGET', KEYS[1], 'generation') or '0')
local new_run = 0
if live == 0 then
    if runs > 0 then
        ended(gen, ARGV[7])
        gen = gen + 1
        new_run = 1
        for k, v in pairs(cjson.decode(ARGV[4])) do redis.call('HSET', KEYS[1], k, v) end
        for _, k in ipairs(cjson.decode(ARGV[5])) do redis.call('HDEL', KEYS[1], k) end
        redis.call('HSET', KEYS[1], 'generation', tostring(gen), 'status', 'running',
                   'retries_used', '0')
        redis.call('HDEL', KEYS[1], 'members', 'spare_nodes', 'generation_by')
    end
    redis.call('HSET', KEYS[1], 'runs', tostring(runs + 1))
end
redis.call('ZADD', KEYS[2], now + lease, ARGV[1])
return {gen, new_run, 0}"""

ADD_MEMBERS = """
local cur = redis.call('HGET', KEYS[1], 'members')
local list = (cur and cur ~= '') and cjson.decode(cur) or {}
local byrank = {}
for _, m in ipairs(list) do byrank[tostring(m.rank)] = m end
local now = tonumber(ARGV[2])
local new = cjson.decode(ARGV[1])
for _, m in ipairs(new) do
    local held = byrank[tostring(m.rank)]
    if held and held.node ~= m.node then
        local lease = redis.call('ZSCORE', KEYS[2], held.node)
        if lease and tonumber(lease) > now then
            return cjson.encode({held_rank = m.rank, node = held.node,
                                 left_ms = tonumber(lease) - now})
        end
    end
end
for _, m in ipairs(new) do byrank[tostring(m.rank)] = m end
local out = {}
for _, m in pairs(byrank) do table.insert(out, m) end
table.sort(out, function(a, b) return a.rank < b.rank end)
local enc = '[]'
if #out > 0 then enc = cjson.encode(out) end
redis.call('HSET', KEYS[1], 'members', enc)
return enc"""

ADD_SPARE = """
local cur = redis.call('HGET', KEYS[1], 'spare_nodes')
local list = (cur and cur ~= '') and cjson.decode(cur) or {}
local seen = {}
local out = {}
for _, n in ipairs(list) do
    if not seen[n] then seen[n] = true; table.insert(out, n) end
end
if not seen[ARGV[1]] then table.insert(out, ARGV[1]) end
table.sort(out)
local enc = cjson.encode(out)
redis.call('HSET', KEYS[1], 'spare_nodes', enc)
return enc"""

END_RUN = """
if redis.call('HGET', KEYS[1], 'status') ~= 'stopped' then
    redis.call('HSET', KEYS[1], 'status', ARGV[1])
end
return 0"""

BUMP_GENERATION = GENERATION_ENDED + """
local cur = tonumber(redis.call('HGET', KEYS[1], 'generation') or '0')
if cur == tonumber(ARGV[1]) then
  redis.call('HSET', KEYS[1], 'generation', tostring(cur + 1), 'generation_by', ARGV[2])
  ended(cur, ARGV[3])
  return cur + 1
end
return cur"""

# KEYS = reputation hash, offence keys, evidence list; ARGV = key, weight, now (ns, text),
# half-life (s), evidence (JSON), evidence kept, status, detail, key TTL (s). Unix ns go in and
# out as text (a Lua number would round them).
ADD_OFFENCE = """
local function decayed()
  local s = tonumber(redis.call('HGET', KEYS[1], 'score') or '0') or 0
  local at = redis.call('HGET', KEYS[1], 'score_ns')
  if not at or at == '' or s == 0 then return s end
  local dt = (tonumber(ARGV[3]) - tonumber(at)) / 1e9
  if dt < 0 then dt = 0 end
  return s * 2 ^ (-dt / tonumber(ARGV[4]))
end
if redis.call('SISMEMBER', KEYS[2], ARGV[1]) == 1 then
  return {0, tostring(decayed())}
end
local score = decayed() + tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'score', tostring(score), 'score_ns', ARGV[3], 'status', ARGV[7],
           'detail', ARGV[8], 'updated_ns', ARGV[3])
redis.call('HINCRBY', KEYS[1], 'offences', 1)
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[9]))
redis.call('RPUSH', KEYS[3], ARGV[5])
redis.call('LTRIM', KEYS[3], -tonumber(ARGV[6]), -1)
return {1, tostring(score)}"""
