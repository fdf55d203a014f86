"""Every Lua script tokenfleet runs on Redis, in one place.

Each runs atomically on one server (on a cluster, over keys of one hash slot). Producers use
:data:`ENQUEUE`, which docs/PROTOCOL.md quotes word for word; the rest are the worker's.
"""

from __future__ import annotations

ENQUEUE = """
-- KEYS[1] request stream, KEYS[2] the max_queue hash; ARGV[1] its queue name, ARGV[2] msgpack body.
-- Adds the request unless the stream already holds max_queue entries no worker has taken yet.
local limit = tonumber(redis.call('HGET', KEYS[2], ARGV[1]))
if limit then
  local depth = redis.call('XLEN', KEYS[1])
  local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', KEYS[1])
  if ok then
    for _, g in ipairs(groups) do
      for i = 1, #g, 2 do
        if g[i] == 'name' and g[i + 1] ~= 'workers' then break end
        if g[i] == 'lag' and g[i + 1] then depth = g[i + 1] end
      end
    end
  end
  if depth >= limit then
    return redis.error_reply('QUEUEFULL ' .. KEYS[1] .. ' holds ' .. depth ..
                             ' waiting requests (max_queue ' .. limit .. ')')
  end
end
return redis.call('XADD', KEYS[1], '*', 'm', ARGV[2])
"""
"""XADD a request unless its bucket's queue is full (PROTOCOL.md, Backpressure)."""

READ_BOUNDED = """
local out = {}
local k = 1
for a = 3, #ARGV, 2 do
  local n, remaining = tonumber(ARGV[a]), tonumber(ARGV[a + 1])
  for i = k, k + n - 1 do
    if remaining > 0 then
      local res = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', remaining,
                             'STREAMS', KEYS[i], '>')
      if res then
        remaining = remaining - #res[1][2]
        table.insert(out, {KEYS[i], res[1][2]})
      end
    end
  end
  k = k + n
end
return out
"""
"""Read new entries for consumer ARGV[2] of group ARGV[1], lane by lane: KEYS are the lanes'
streams in turn, and each pair of ARGV after the first two says how many of KEYS are the next
lane's and the most entries to read from them in all (XREADGROUP's COUNT is per stream): the
no-hoarding bound holds exactly, in one round trip."""

PUBLISH = """
local errors = {}
local a = 1
for k = 1, #KEYS do
  local n = tonumber(ARGV[a + 1])
  local reply = redis.pcall(ARGV[a], KEYS[k], unpack(ARGV, a + 2, a + 1 + n))
  if type(reply) == 'table' and reply.err then
    errors[#errors + 1] = k
    errors[#errors + 1] = reply.err
  end
  a = a + 2 + n
end
return errors
"""
"""Run one step's writes as one atomic call: KEYS[k] is the k-th command's key; ARGV holds, for
each, its name, argument count and arguments. Every command runs; refusals come back as
{k, message, ...} (e.g. a copy of an event refused at its fixed id)."""

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
