-- Argo CD health of a relaytrain FineTuneJob: the value of
-- `resource.customizations.health.relaytrain.io_FineTuneJob` in argocd-cm
-- (docs/operator.md, "GitOps health"). It reads only what the operator writes:
-- status.phase, observedGeneration, the conditions and status.pipelines.
--   Healthy      Running (every pipeline training) or Succeeded
--   Progressing  not observed yet, Pending, Planning, Recovering, or a pipeline being replaced
--   Degraded     Failed, Stalled (e.g. the model cannot be read), a pipeline given up, or
--                a queue that cannot admit the job (Kueue: reason Inadmissible)
--   Suspended    spec.suspend is true, or queued for Kueue's quota
-- (Missing is Argo CD's own word for an object that does not exist; no status says it.)
local hs = {}

local function condition(kind)
  if obj.status.conditions ~= nil then
    for _, c in ipairs(obj.status.conditions) do
      if c.type == kind then
        return c
      end
    end
  end
  return nil
end

local function holds(kind)
  local c = condition(kind)
  return c ~= nil and c.status == "True"
end

local function said(kind, fallback)
  local c = condition(kind)
  if c ~= nil and c.message ~= nil and c.message ~= "" then
    return c.message
  end
  return fallback
end

if obj.status == nil or obj.status.phase == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the relaytrain operator to plan the job"
  return hs
end

local generation = obj.metadata.generation
local observed = obj.status.observedGeneration
if generation ~= nil and observed ~= nil and observed < generation then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to act on generation " .. generation
  return hs
end

local phase = obj.status.phase
if phase == "Succeeded" then
  hs.status = "Healthy"
  hs.message = said("Ready", "Training finished")
elseif phase == "Suspended" then
  -- Queued is a pause; a LocalQueue or ClusterQueue that is missing or inactive, or no
  -- Kueue at all, is a mistake in what was deployed, and nothing starts until it is fixed.
  local ready = condition("Ready")
  if ready ~= nil and (ready.reason == "Inadmissible" or ready.reason == "KueueNotInstalled") then
    hs.status = "Degraded"
  else
    hs.status = "Suspended"
  end
  hs.message = said("Ready", "Suspended")
elseif phase == "Failed" or holds("Stalled") then
  hs.status = "Degraded"
  hs.message = said("Stalled", said("Ready", "Failed"))
elseif phase == "Running" and holds("Degraded") then
  hs.status = "Progressing"
  if obj.status.pipelines ~= nil then
    for _, p in ipairs(obj.status.pipelines) do
      if p.phase == "Failed" then
        hs.status = "Degraded"
      end
    end
  end
  hs.message = said("Degraded", "A pipeline is out")
elseif phase == "Running" then
  hs.status = "Healthy"
  hs.message = said("Ready", "Training")
else
  hs.status = "Progressing"
  hs.message = said("Ready", phase)
end
return hs
