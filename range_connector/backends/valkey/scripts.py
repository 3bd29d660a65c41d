"""The Lua scripts that the Valkey tier runs inside the server, each call one atomic step.

``RESERVE_LUA`` (evict least-recently-used unleased stripes, then register a new one), ``COMMIT_LUA`` (publish a
registered stripe's tickets, or refuse), ``FORGET_LUA`` (drop one stripe), ``CLEAR_LUA`` (remove a batch of a
deployment's keys) and ``CLEARED_LUA`` take the deployment's key prefix as ``ARGV[1]``; ``LEASE_LUA`` and
``RELEASE_LUA`` take the lease keys in ``KEYS``. The keys are those :mod:`range_connector.backends.valkey.client`
lays out: ``s:<stripe>:<layer>`` values, ``m:<stripe>`` manifests (msgpack ``[bytes, layers, ticket keys,
deployment]``), tickets, ``w:<stripe>`` write guards (holding the reset epoch the write began in), ``lru``, ``used``,
``epoch`` (how many times the deployment was cleared) and ``l:<stripe>`` leases.
"""

from __future__ import annotations

# Drop one stripe: its layer values, its manifest, the tickets that still point at it (a ticket re-pointed to a newer
# stripe stays), its write guard and its LRU entry; give its bytes back. Nothing read from the store is trusted: a
# manifest or ticket that does not parse is skipped, never an error that would block every later eviction.
_DROP_LUA = """
local function drop(p, sid)
  local freed = 0
  local raw = server.call('GET', p .. 'm:' .. sid)
  if raw then
    local ok, man = pcall(cmsgpack.unpack, raw)
    if ok and type(man) == 'table' then
      for l = 0, (tonumber(man[2]) or 0) - 1 do server.call('DEL', p .. 's:' .. sid .. ':' .. l) end
      if type(man[3]) == 'table' then
        for _, key in ipairs(man[3]) do
          local t = server.call('GET', key)
          if t then
            local tok, tv = pcall(cmsgpack.unpack, t)
            if tok and type(tv) == 'table' and tv[2] == sid then server.call('DEL', key) end
          end
        end
      end
      freed = tonumber(man[1]) or 0
    end
    server.call('DEL', p .. 'm:' .. sid)
    if freed > 0 then server.call('DECRBY', p .. 'used', freed) end
  end
  server.call('DEL', p .. 'w:' .. sid)
  server.call('ZREM', p .. 'lru', sid)
  return freed
end
"""

# A lease key ``l:<stripe>`` is a hash of lease token -> expiry (server time, ms); the stripe is leased while any
# holder's expiry is ahead (expired holders are pruned on the way). The key's own time-to-live is the longest lease.
_LEASED_LUA = """
local function now_ms()
  local t = server.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function leased(key, now)
  local kind = server.call('TYPE', key).ok
  if kind == 'none' then return false end
  if kind ~= 'hash' then return true end
  local kv, live = server.call('HGETALL', key), false
  for i = 1, #kv, 2 do
    if tonumber(kv[i + 1]) > now then live = true else server.call('HDEL', key, kv[i]) end
  end
  return live
end
"""

# Make room for a stripe of ARGV[2] bytes under a budget of ARGV[3] bytes: evict least-recently-used stripes that
# hold no lease and are not being written, with the tickets that still point at them. Then register the stripe in
# the same atomic step (manifest ARGV[5], LRU score ARGV[6], its bytes, and a write guard for ARGV[7] ms that keeps
# it from being evicted before its values land), so that ``used`` always equals the bytes of the listed stripes,
# whatever happens to the write afterwards. The guard holds the deployment's reset epoch at this moment, so that
# COMMIT_LUA can tell a clear that came in between: the epoch the write was gathered in (ARGV[8], when given: a clear
# between the gathering and the reservation counts too), else the current one. A budget below 0 is no budget.
# Returns 1, or 0 if there is no room.
RESERVE_LUA = _DROP_LUA + _LEASED_LUA + """
local p, sid = ARGV[1], ARGV[4]
local now = now_ms()
local need = tonumber(ARGV[2])
local budget = tonumber(ARGV[3])
if budget >= 0 and need > budget then return 0 end
local used = tonumber(server.call('GET', p .. 'used') or '0')
local idx = 0
while budget >= 0 and used + need > budget do
  local members = server.call('ZRANGE', p .. 'lru', idx, idx)
  if #members == 0 then return 0 end
  local victim = members[1]
  if leased(p .. 'l:' .. victim, now) or server.call('EXISTS', p .. 'w:' .. victim) > 0 then
    idx = idx + 1
  else
    used = used - drop(p, victim)
  end
end
server.call('SET', p .. 'm:' .. sid, ARGV[5])
server.call('ZADD', p .. 'lru', ARGV[6], sid)
server.call('INCRBY', p .. 'used', need)
local gathered = ARGV[8]
if gathered == nil or gathered == '' then gathered = server.call('GET', p .. 'epoch') or '0' end
server.call('SET', p .. 'w:' .. sid, gathered, 'PX', ARGV[7])
return 1
"""

# Publish the tickets ARGV[4..] (key, value, key, value, ...) of the stripe ARGV[2] of ARGV[3] layers, whose values
# were just sent, if it is still registered in the reset epoch it was reserved in; otherwise (a clear came in
# between, or the guard expired) remove whatever of it exists. Returns 1 if published, else 0.
COMMIT_LUA = _DROP_LUA + """
local p, sid = ARGV[1], ARGV[2]
local guard = server.call('GET', p .. 'w:' .. sid)
local epoch = server.call('GET', p .. 'epoch') or '0'
if guard == epoch and server.call('EXISTS', p .. 'm:' .. sid) == 1 then
  for i = 4, #ARGV, 1000 do server.call('MSET', unpack(ARGV, i, math.min(i + 999, #ARGV))) end
  server.call('DEL', p .. 'w:' .. sid)
  return 1
end
drop(p, sid)
for l = 0, tonumber(ARGV[3]) - 1 do server.call('DEL', p .. 's:' .. sid .. ':' .. l) end
return 0
"""

# Remove the keys in KEYS (one SCAN batch of the deployment ARGV[1]): the stripe of a manifest, a layer value or a
# write guard goes whole, with its values, tickets and bytes (so ``used`` and ``lru`` stay exact, and a write whose
# keys the scan met cannot commit afterwards); every other key but ``epoch``, ``used`` and ``lru`` is deleted.
# Returns the number of keys given.
CLEAR_LUA = _DROP_LUA + """
local p = ARGV[1]
local keep = {[p .. 'epoch'] = true, [p .. 'used'] = true, [p .. 'lru'] = true}
local mp, sp, wp = p .. 'm:', p .. 's:', p .. 'w:'
for _, k in ipairs(KEYS) do
  local sid = nil
  if string.sub(k, 1, #mp) == mp or string.sub(k, 1, #wp) == wp then
    sid = string.sub(k, #mp + 1)
  elseif string.sub(k, 1, #sp) == sp then
    sid = string.match(string.sub(k, #sp + 1), '^([^:]+):')
  end
  if sid then drop(p, sid) end
  if not keep[k] then
    server.call('DEL', k)
  end
end
return #KEYS
"""

# After the last batch: stripes still listed in ``lru`` whose manifest is gone are forgotten, and with no stripe
# left ``used`` goes. Returns the bytes still accounted (0 for a deployment that nobody wrote to meanwhile).
CLEARED_LUA = _DROP_LUA + """
local p = ARGV[1]
for _, sid in ipairs(server.call('ZRANGE', p .. 'lru', 0, -1)) do
  if server.call('EXISTS', p .. 'm:' .. sid) == 0 then server.call('ZREM', p .. 'lru', sid) end
end
if server.call('ZCARD', p .. 'lru') == 0 then server.call('DEL', p .. 'used', p .. 'lru') end
return tonumber(server.call('GET', p .. 'used') or '0')
"""

# Forget the stripe ARGV[2] (a write that failed half-way).
FORGET_LUA = _DROP_LUA + """
drop(ARGV[1], ARGV[2])
return 1
"""

# Take a lease with token ARGV[1] for ARGV[2] ms on each key in KEYS (the stripes ARGV[5..] in the same order),
# extending the key's time-to-live but never shortening it, and mark the stripes used (LRU ARGV[3], score ARGV[4]).
LEASE_LUA = _LEASED_LUA + """
local exp = now_ms() + tonumber(ARGV[2])
for i, k in ipairs(KEYS) do
  if server.call('TYPE', k).ok ~= 'hash' then server.call('DEL', k) end
  server.call('HSET', k, ARGV[1], exp)
  if server.call('PTTL', k) < tonumber(ARGV[2]) then server.call('PEXPIRE', k, ARGV[2]) end
  server.call('ZADD', ARGV[3], 'XX', ARGV[4], ARGV[4 + i])
end
return 1
"""

# Release the lease with token ARGV[1] on each key in KEYS (without a token, ARGV[1] == '': the one that expires
# first); a key without live holders goes.
RELEASE_LUA = _LEASED_LUA + """
local now = now_ms()
for _, k in ipairs(KEYS) do
  if server.call('TYPE', k).ok == 'hash' then
    local field = ARGV[1]
    if field == '' then
      local kv, first = server.call('HGETALL', k), nil
      for i = 1, #kv, 2 do
        if first == nil or tonumber(kv[i + 1]) < tonumber(first[2]) then first = {kv[i], kv[i + 1]} end
      end
      if first then field = first[1] end
    end
    server.call('HDEL', k, field)
    if not leased(k, now) then server.call('DEL', k) end
  end
end
return 1
"""
