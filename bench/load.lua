-- wrk script for bench/load.sh and tests/system/test_load.py: every
-- connection alternates GET /v1/params (every variable, one safetensors
-- body) and GET /v1/status, as pulling workers and dashboards would.
-- wrk's summary counts non-2xx answers ("Non-2xx or 3xx responses") and
-- socket errors.
local paths = {"/v1/params", "/v1/status"}
local n = 0
request = function()
  n = n + 1
  return wrk.format("GET", paths[n % 2 + 1])
end
