"""The Redis tier's Lua scripts: every change to its shared accounting runs inside Redis, atomically.

The data model they keep under `key_prefix` is described in `kvtier.stores.redis`. `COMMIT` renames a put's
temporary values into place (evicting least recently used leaves to make room), `TOUCH` marks hits as
recently used, `DROP` removes blocks with their descendants, `RECLAIM` frees room when Redis itself is full.
`allow-oom` (a `#!lua` flag, Redis/Valkey 7 and newer) lets a full Redis still be freed and touched.
"""

from __future__ import annotations

_COMMON = """
local P = ARGV[1]
local USED, CLOCK, META, TICK, LEAVES = P..'!used', P..'!clock', P..'!meta', P..'!tick', P..'!leaves'
local CAP = P..'!cap'  -- set when Redis refused a put for memory (RECLAIM): the bound below max_bytes it allows
local used = tonumber(redis.call('GET', USED) or '0')
local function kids(id) return P..'!kids:'..id end
local function meta(id)
  local m = redis.call('HGET', META, id)
  if not m then return nil end
  local sp = string.find(m, ' ', 1, true)
  return tonumber(string.sub(m, 1, sp - 1)), string.sub(m, sp + 1)
end
local function touch(id)
  local t = redis.call('INCR', CLOCK)
  redis.call('HSET', TICK, id, t)
  redis.call('ZADD', LEAVES, 'XX', t, id)
end
local function forget(id)  -- one block; its parent becomes a leaf when this was its last child
  local size, parent = meta(id)
  redis.call('DEL', P..id)
  redis.call('ZREM', LEAVES, id)
  if not size then return 0 end
  redis.call('HDEL', META, id)
  redis.call('HDEL', TICK, id)
  used = used - size
  if parent ~= '' then
    redis.call('SREM', kids(parent), id)
    if redis.call('SCARD', kids(parent)) == 0 and redis.call('HEXISTS', META, parent) == 1 then
      redis.call('ZADD', LEAVES, redis.call('HGET', TICK, parent), parent)
    end
  end
  return 1
end
local function evict_to(limit, keep)  -- least recently used leaves go until `used` <= limit; false if `keep`
  local n = 0                          -- (or nothing) is the next one
  while used > limit do
    local lru = redis.call('ZRANGE', LEAVES, 0, 0)[1]
    if lru == nil or lru == keep then return n, false end
    n = n + forget(lru)
  end
  return n, true
end
local function drop(id)  -- a block and all its descendants
  local stack, n = {id}, 0
  while #stack > 0 do
    local x = table.remove(stack)
    for _, c in ipairs(redis.call('SMEMBERS', kids(x))) do table.insert(stack, c) end
    redis.call('DEL', kids(x))
    n = n + forget(x)
  end
  return n
end
"""

# ARGV: prefix, max_bytes, then (temporary key, id, parent id or '') per block, parents before children.
_COMMIT_SOURCE = _COMMON + """
local max = math.min(tonumber(ARGV[2]), tonumber(redis.call('GET', CAP) or ARGV[2]))
local out, evicted = {}, 0
local last = nil  -- the block the previous iteration stored: present, and already the newest leaf
for i = 3, #ARGV, 3 do
  local tmp, id, parent = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local size = redis.call('STRLEN', tmp)
  local status = 'stored'
  local chained = parent ~= '' and parent == last
  last = nil
  if size == 0 then status = 'failed'
  elseif redis.call('HEXISTS', META, id) == 1 then touch(id); status = 'exists'
  elseif parent ~= '' and not chained and redis.call('HEXISTS', META, parent) == 0 then status = 'orphan'
  elseif size > max then status = 'too_big'
  else
    if parent ~= '' and not chained then touch(parent) end  -- the newest leaf now: evicted last, then we stop
    local n, room = evict_to(max - size, parent)
    evicted = evicted + n
    if not room then status = 'no_room' end
  end
  if status == 'stored' then
    redis.call('RENAME', tmp, P..id)
    redis.call('PERSIST', P..id)
    local t = redis.call('INCR', CLOCK)
    redis.call('HSET', META, id, size..' '..parent)
    redis.call('HSET', TICK, id, t)
    redis.call('ZADD', LEAVES, t, id)
    if parent ~= '' then
      redis.call('SADD', kids(parent), id)
      redis.call('ZREM', LEAVES, parent)
    end
    used = used + size
    last = id
  else
    redis.call('DEL', tmp)
  end
  out[#out + 1] = status
end
redis.call('SET', USED, used)
out[#out + 1] = evicted
return out
"""

# allow-oom: a Redis that is full (maxmemory) must still let us free it, and touching is harmless.
# TOUCH is `touch` on each of ARGV[2..] that the tier holds, in order (the same ticks), in four calls per chunk
# of blocks instead of four per block; chunks, because Lua's unpack takes a bounded number of values.
_TOUCH_SOURCE = "#!lua flags=allow-oom\n" + _COMMON + """
for first = 2, #ARGV, 1024 do
  local ids, live = {}, {}
  for i = first, math.min(first + 1023, #ARGV) do ids[#ids + 1] = ARGV[i] end
  local held = redis.call('HMGET', META, unpack(ids))
  for i, id in ipairs(ids) do if held[i] then live[#live + 1] = id end end
  if #live > 0 then
    local t, ticks, leaves = redis.call('INCRBY', CLOCK, #live) - #live, {}, {}
    for i, id in ipairs(live) do
      ticks[2 * i - 1], ticks[2 * i] = id, t + i
      leaves[2 * i - 1], leaves[2 * i] = t + i, id
    end
    redis.call('HSET', TICK, unpack(ticks))
    redis.call('ZADD', LEAVES, 'XX', unpack(leaves))
  end
end
return 0
"""

_DROP_SOURCE = "#!lua flags=allow-oom\n" + _COMMON + """
local n = 0
for i = 2, #ARGV do n = n + drop(ARGV[i]) end
redis.call('SET', USED, used)
return n
"""


# ARGV: prefix, the refused put's bytes, one block's bytes, how long the cap holds (ms), the reclaim count the put
# saw when it was sent ('' for none). Redis refused a put for memory: its maxmemory, not our max_bytes, is the
# bound. What the tier held less one such put becomes its cap (never below one block; a lower cap another engine
# set stays as it is), and least recently used leaves go until it holds one put less than that: room for the next
# put's temporary values. Puts refused together (several writers) were refused for one shortage: the first reclaim
# answers it, and a put sent before that reclaim ran lowers nothing more (-1), or k refusals would lower the cap
# by 2k-1 puts. A put sent after it and refused still is a shortage of its own.
_RECLAIM_SOURCE = "#!lua flags=allow-oom\n" + _COMMON + """
local RECLAIMS = P..'!reclaims'
if ARGV[5] ~= '' and (redis.call('GET', RECLAIMS) or '0') ~= ARGV[5] then return -1 end
redis.call('INCR', RECLAIMS)
local put, block = tonumber(ARGV[2]), tonumber(ARGV[3])
local cap = math.max(used - put, block)
local evicted = evict_to(cap - put, nil)
redis.call('SET', USED, used)
if cap <= tonumber(redis.call('GET', CAP) or cap) then redis.call('SET', CAP, cap, 'PX', ARGV[4]) end
return evicted
"""


COMMIT = _COMMIT_SOURCE.encode()
TOUCH = _TOUCH_SOURCE.encode()
DROP = _DROP_SOURCE.encode()
RECLAIM = _RECLAIM_SOURCE.encode()
