"""The Lua scripts that change the shared session space, each one atomic step (layout: `redis_tree`).

CLAIM: the session and next turn id of a turn about to run, marked in flight. COMMIT: a claimed turn and its index
entries, refused when the session closed meanwhile. CLOSE: a live session's turns and index entries removed, its turn
counter kept as a tombstone (`closed` 1, or 2 when its driver closed it). RESTORE: a named session put back from its
record files.
"""

CLAIM = """
local P, sid, now = ARGV[5], ARGV[1], ARGV[7]
if sid == '' then
  sid = redis.call('HGET', KEYS[1], ARGV[2])
  if not sid then
    sid = ARGV[3]
    redis.call('HSET', KEYS[1], ARGV[2], sid)
    redis.call('HSET', P .. ':s:{' .. sid .. '}', 'automatic', 1, 'namespace', ARGV[4], 'nsh', ARGV[9],
      'prompt', ARGV[2], 'created', now, 'next', 0, 'turns', 0, 'tokens', 0, 'closed', 0)
  end
end
local meta = P .. ':s:{' .. sid .. '}'
local closed = redis.call('HGET', meta, 'closed')
if not closed then
  if ARGV[6] ~= '1' then return {sid, -1} end
  redis.call('HSET', meta, 'automatic', 0, 'namespace', '', 'nsh', ARGV[9], 'created', now, 'next', 0, 'turns', 0,
    'tokens', 0, 'closed', 0)
elseif closed == '2' and ARGV[11] ~= '1' then
  return {sid, -2}
elseif closed ~= '0' then
  if ARGV[6] ~= '1' or redis.call('HGET', meta, 'automatic') == '1' then return {sid, -1} end
  redis.call('HSET', meta, 'closed', 0)
  redis.call('PERSIST', meta)
end
if ARGV[10] ~= '' and redis.call('EXISTS', P .. ':n:{' .. sid .. '}:' .. ARGV[10]) == 0 then return {sid, -1} end
local turn = redis.call('HINCRBY', meta, 'next', 1) - 1
redis.call('ZADD', P .. ':b:{' .. sid .. '}', ARGV[8], turn)
redis.call('ZADD', KEYS[2], now, sid)
return {sid, turn}
"""

COMMIT = """
if redis.call('HGET', KEYS[1], 'closed') ~= '0' then return 0 end
redis.call('SET', KEYS[2], ARGV[1])
local entries = redis.call('HGET', KEYS[3], ARGV[2]) or ''
redis.call('HSET', KEYS[3], ARGV[2], entries .. ARGV[3])
redis.call('APPEND', KEYS[7], ARGV[4])
redis.call('HINCRBY', KEYS[1], 'turns', 1)
redis.call('HINCRBY', KEYS[1], 'tokens', tonumber(ARGV[5]))
if ARGV[6] ~= '' then redis.call('HSET', KEYS[4], ARGV[6], ARGV[7]) end
redis.call('ZREM', KEYS[6], ARGV[8])
redis.call('ZADD', KEYS[5], ARGV[9], ARGV[10])
return 1
"""

CLOSE = """
local sid, P, now = ARGV[1], ARGV[2], ARGV[3]
local meta = P .. ':s:{' .. sid .. '}'
local m = redis.call('HMGET', meta, 'closed', 'automatic', 'nsh', 'prompt', 'next', 'turns')
if m[1] ~= '0' then
  redis.call('ZREM', KEYS[1], sid)
  if m[1] and ARGV[6] == '1' then
    redis.call('HSET', meta, 'closed', 2)
    redis.call('EXPIRE', meta, ARGV[5])
    return -2
  end
  return -1
end
local busy = P .. ':b:{' .. sid .. '}'
redis.call('ZREMRANGEBYSCORE', busy, '-inf', now)
if redis.call('ZCARD', busy) > 0 then return -3 end
if ARGV[4] ~= '' then
  local score = redis.call('ZSCORE', KEYS[1], sid)
  if score and tonumber(score) > tonumber(ARGV[4]) then return -1 end
end
local auto = m[2] == '1'
local index = auto and (P .. ':ap:' .. m[3]) or (P .. ':p:{' .. sid .. '}')
local ledgerkey = P .. ':x:{' .. sid .. '}'
local ledger = redis.call('GET', ledgerkey) or ''
local i = 1
while i <= #ledger do
  local path = string.sub(ledger, i, i + 15)
  local size = string.byte(ledger, i + 16) + 256 * string.byte(ledger, i + 17)
  local reply = string.sub(ledger, i + 18, i + 17 + size)
  i = i + 18 + size
  if auto then
    local v = redis.call('HGET', index, path)
    if v then
      local kept = {}
      for j = 1, #v, 36 do
        local e = string.sub(v, j, j + 35)
        if string.sub(e, 1, 32) ~= sid then kept[#kept + 1] = e end
      end
      if #kept == 0 then redis.call('HDEL', index, path) else redis.call('HSET', index, path, table.concat(kept)) end
    end
  end
  if reply ~= '' then redis.call('HDEL', P .. ':r', reply) end
end
for t = 0, tonumber(m[5]) - 1 do redis.call('DEL', P .. ':n:{' .. sid .. '}:' .. t) end
redis.call('DEL', ledgerkey)
if not auto then redis.call('DEL', index) end
if auto and m[4] then
  local groups = P .. ':g:' .. m[3]
  if redis.call('HGET', groups, m[4]) == sid then redis.call('HDEL', groups, m[4]) end
end
redis.call('DEL', busy)
redis.call('HSET', meta, 'closed', ARGV[6] == '1' and 2 or 1)
redis.call('EXPIRE', meta, ARGV[5])
redis.call('ZREM', KEYS[1], sid)
return tonumber(m[6])
"""

RESTORE = """
local sid, now = ARGV[1], ARGV[2]
local closed = redis.call('HGET', KEYS[1], 'closed')
if closed == '0' then return 0 end
local next = math.max(tonumber(redis.call('HGET', KEYS[1], 'next') or '0'), tonumber(ARGV[3]))
local turns, tokens = 0, 0
redis.call('DEL', KEYS[5])
for i = 5, #ARGV, 7 do
  local t = tonumber(ARGV[i])
  redis.call('SET', ARGV[i + 1], ARGV[i + 2])
  local entries = redis.call('HGET', KEYS[2], ARGV[i + 3]) or ''
  redis.call('HSET', KEYS[2], ARGV[i + 3], entries .. ARGV[i + 4])
  redis.call('APPEND', KEYS[5], ARGV[i + 5])
  if ARGV[i + 6] ~= '' then redis.call('HSET', KEYS[3], ARGV[i + 6], sid .. '\\n' .. t) end
  if t + 1 > next then next = t + 1 end
  turns = turns + 1
end
redis.call('HSET', KEYS[1], 'automatic', 0, 'namespace', '', 'created', now, 'next', next, 'turns', turns,
  'tokens', ARGV[4], 'closed', 0)
redis.call('PERSIST', KEYS[1])
redis.call('ZADD', KEYS[4], now, sid)
return 1
"""
