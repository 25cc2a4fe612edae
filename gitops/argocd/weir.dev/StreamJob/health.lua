-- Argo CD health check for weir.dev/StreamJob (Lua 5.1, as Argo CD runs it).
--
-- Maps the status the Weir operator writes to Argo CD's health:
--   not yet observed (no status, or status.observedGeneration < metadata.generation)
--                                        -> Progressing: the operator has not acted on this spec
--   phase Failed or Degraded, or the Degraded condition True
--                                        -> Degraded, with the condition's message
--   phase Suspended or Cancelled         -> Suspended
--   phase Running or Finished            -> Healthy
--   any other phase (Deploying, Upgrading, Suspending, Cancelling, Relaunching)
--                                        -> Progressing, with the Progressing condition's message
-- Install: argocd-cm `resource.customizations.health.weir.dev_StreamJob: |` + this file
-- (see docs/gitops.md). Tests: health_test.yaml, run by .ci/run (gitops/check).
local hs = {}

local function condition(kind)
  if obj.status == nil or obj.status.conditions == nil then
    return nil
  end
  for _, c in ipairs(obj.status.conditions) do
    if c.type == kind then
      return c
    end
  end
  return nil
end

if obj.status == nil or obj.status.phase == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the Weir operator to report the job's status"
  return hs
end

local generation = obj.metadata.generation
local observed = obj.status.observedGeneration
if generation ~= nil and (observed == nil or observed < generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the Weir operator to act on generation " .. tostring(generation)
  return hs
end

local phase = obj.status.phase
local degraded = condition("Degraded")
local degraded_now = degraded ~= nil and degraded.status == "True"

if phase == "Failed" or phase == "Degraded" or degraded_now then
  hs.status = "Degraded"
  if degraded_now and degraded.message ~= nil and degraded.message ~= "" then
    hs.message = degraded.message
  else
    hs.message = "The job is in phase " .. phase .. ": see its events (kubectl describe streamjob)"
  end
  return hs
end

if phase == "Suspended" or phase == "Cancelled" then
  hs.status = "Suspended"
  hs.message = "The job is " .. string.lower(phase)
  return hs
end

if phase == "Running" or phase == "Finished" then
  hs.status = "Healthy"
  hs.message = "The job is " .. string.lower(phase)
  return hs
end

local progressing = condition("Progressing")
hs.status = "Progressing"
if progressing ~= nil and progressing.message ~= nil and progressing.message ~= "" then
  hs.message = progressing.message
else
  hs.message = phase .. " in progress"
end
return hs
