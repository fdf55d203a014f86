"""Every Lua script tokenfleet runs on Redis, in one place.

Each runs atomically on one server (on a cluster, over keys of one hash slot). Producers use
:data:`ENQUEUE`, which docs/PROTOCOL.md quotes word for word; the rest are the worker's.
"""

from __future__ import annotations

ENQUEUE = """
-- KEYS[1] request stream, KEYS[2] the max_queue hash, KEYS[3..] every stream of KEYS[1]'s queue
-- (the bucket's stream and its shards; none: KEYS[1] alone); ARGV[1] the queue's name, ARGV[2]
-- msgpack body. Adds the request unless the queue holds max_queue entries no worker has taken yet.
local limit = tonumber(redis.call('HGET', KEYS[2], ARGV[1]))
if limit then
  local depth = 0
  local first = 3
  if #KEYS < 3 then first = 1 end
  for k = first, #KEYS do
    if k ~= 2 then
      local waiting = redis.call('XLEN', KEYS[k])
      local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', KEYS[k])
      if ok then
        for _, g in ipairs(groups) do
          for i = 1, #g, 2 do
            if g[i] == 'name' and g[i + 1] ~= 'workers' then break end
            if g[i] == 'lag' and g[i + 1] then waiting = g[i + 1] end
          end
        end
      end
      depth = depth + waiting
    end
  end
  if depth >= limit then
    return redis.error_reply('QUEUEFULL ' .. ARGV[1] .. ' holds ' .. depth ..
                             ' waiting requests (max_queue ' .. limit .. ')')
  end
end
return redis.call('XADD', KEYS[1], '*', 'm', ARGV[2])
"""
"""XADD a request unless its queue is full (PROTOCOL.md, Backpressure)."""

READ_BOUNDED = """
local out = {}
local k = 1
local now = redis.call('TIME')
local cutoff = string.format('%.0f', now[1] * 1000 + math.floor(now[2] / 1000) - tonumber(ARGV[3]))
for a = 4, #ARGV, 3 do
  local n_own, n_other, remaining = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  for i = k, k + n_own + n_other - 1 do
    local count = remaining
    if count > 0 and redis.call('XLEN', KEYS[i]) == 0 then  -- most shards are empty most of the time
      count = 0
    elseif i >= k + n_own and count > 0 then  -- another's shard: only what waited past the cutoff
      count = 0
      local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', KEYS[i])
      if ok then
        for _, g in ipairs(groups) do
          local name, last
          for j = 1, #g, 2 do
            if g[j] == 'name' then name = g[j + 1] end
            if g[j] == 'last-delivered-id' then last = g[j + 1] end
          end
          if name == ARGV[1] then
            count = #redis.call('XRANGE', KEYS[i], '(' .. last, cutoff, 'COUNT', remaining)
          end
        end
      end
    end
    if count > 0 then
      local res = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', count,
                             'STREAMS', KEYS[i], '>')
      if res then
        remaining = remaining - #res[1][2]
        table.insert(out, {KEYS[i], res[1][2]})
      end
    end
  end
  k = k + n_own + n_other
end
return out
"""
"""Read new entries for consumer ARGV[2] of group ARGV[1], lane by lane: KEYS are the lanes'
streams in turn; each triple of ARGV after the first three says how many of KEYS are the lane's
own streams, how many are other workers' shards after them, and the most entries to read from
them in all (XREADGROUP's COUNT is per stream): the no-hoarding bound holds exactly, in one round
trip. From another's shard only entries that have waited ARGV[3] ms or more (by Redis's clock)
are taken: its owner had its chance first."""

PUBLISH = """
local errors = {}
local a = 1
for k = 1, #KEYS do
  local n = tonumber(ARGV[a + 1])
  local reply = redis.pcall(ARGV[a], KEYS[k], unpack(ARGV, a + 2, a + 1 + n))
  if type(reply) == 'table' and reply.err then
    if string.sub(reply.err, 1, 3) == 'OOM' then  -- Redis is full: acknowledge nothing after it
      return redis.error_reply(reply.err)
    end
    errors[#errors + 1] = k
    errors[#errors + 1] = reply.err
  end
  a = a + 2 + n
end
return errors
"""
"""Run one step's writes as one atomic call: KEYS[k] is the k-th command's key; ARGV holds, for
each, its name, argument count and arguments. Every command runs; refusals come back as
{k, message, ...} (e.g. a copy of an event refused at its fixed id). A write refused for memory
(OOM: Redis full under noeviction) ends the script with that error, before any acknowledgement
after it: the worker sends it all again later (events at fixed ids and XACK are idempotent)."""

TRIM_ACKED = """
local pending = redis.call('XPENDING', KEYS[1], ARGV[1])
local minid
if pending[1] > 0 then
  minid = pending[2]
else
  local last
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
    local name, delivered
    for i = 1, #g, 2 do
      if g[i] == 'name' then name = g[i + 1] end
      if g[i] == 'last-delivered-id' then delivered = g[i + 1] end
    end
    if name == ARGV[1] then last = delivered end
  end
  if not last or last == '0-0' then return 0 end
  local ms, seq = string.match(last, '(%d+)-(%d+)')
  minid = ms .. '-' .. (tonumber(seq) + 1)
end
return redis.call('XTRIM', KEYS[1], 'MINID', minid)
"""
"""Drop the entries group ARGV[1] has acknowledged, and nothing else: those older than the oldest
pending entry, or, with nothing pending, all up to the last delivered one."""
