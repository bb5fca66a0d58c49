"""The kustomize overlay `kvrelay plan --out DIR` writes: deploy/k8s with the planned pools.

It builds on deploy/k8s/overlays/gpu (GPU profiles) or overlays/cpu (a CPU profile) and patches, in the
conventions of deploy/ (strategic-merge patches by path; tunables as KVRELAY_<FLAG> environment variables;
the HPAs own the replica counts):
- each pool's HorizontalPodAutoscaler: minReplicas, maxReplicas, its Pods metrics and targets (served by the
  Prometheus adapter rules of deploy/k8s/base), and the behaviour the planner simulated;
- each pool's engine budget (KVRELAY_MAX_NUM_BATCHED_TOKENS, KVRELAY_MAX_NUM_SEQS).
A colocated plan deletes the prefill pool (`$patch: delete`: its Deployment, Service, HPA and disruption
budget): the decode pods prefill everything themselves.

A pool with a schedule is scaled by KEDA (https://keda.sh, installed in the cluster) instead: the overlay deletes
its HPA and adds a ScaledObject that makes one of the same name, with one cron trigger per step of the schedule
(the trace's period taken as one day, UTC) and one Prometheus trigger per metric, with the same per-pod targets
and behaviour. KEDA takes the largest replica count any trigger asks for, as the simulator does.
The files are YAML written as JSON (a subset of YAML), so that writing them needs no YAML library.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvrelay.sim.autoscale import HPAPolicy, PoolPolicy, Schedule
from kvrelay.sim.timemodel import Profile

DEPLOY_K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
# Prometheus series -> the custom metric the adapter serves it as (deploy/k8s/base/prometheus-adapter-rules.yaml).
ADAPTER_NAMES = {"kvrelay:queued_prefill_tokens": "kvrelay_queued_prefill_tokens",
                 "vllm:num_requests_waiting": "vllm_num_requests_waiting",
                 "vllm:num_requests_running": "vllm_num_requests_running",
                 "vllm:kv_cache_usage_perc": "vllm_kv_cache_usage_perc"}
_LABELS = {"app.kubernetes.io/name": "kvrelay", "app.kubernetes.io/part-of": "kvrelay"}


def _target(value: float) -> str:
    return str(round(value)) if value >= 10 else f"{value:g}"


# The pool's total of each metric, as KEDA's Prometheus trigger wants it (it divides by the replicas itself).
_POOL_QUERIES = {"vllm:kv_cache_usage_perc": "sum(max by (pod) ({series}{{{selector}}}))"}


def _behavior(p: PoolPolicy) -> dict:
    return {"scaleUp": {"stabilizationWindowSeconds": 0,
                        "policies": [{"type": "Pods", "value": p.up_pods, "periodSeconds": int(p.up_period_s)}]},
            "scaleDown": {"stabilizationWindowSeconds": int(p.down_window_s),
                          "policies": [{"type": "Pods", "value": p.down_pods, "periodSeconds": int(p.down_period_s)}]}}


def hpa(pool: str, p: PoolPolicy, sync_s: float) -> dict:
    metrics = [{"type": "Pods", "pods": {"metric": {"name": ADAPTER_NAMES[name]},
                                         "target": {"type": "AverageValue", "averageValue": _target(value)}}}
               for name, value in p.targets.items()]
    return {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": f"kvrelay-{pool}", "labels": {**_LABELS, "app.kubernetes.io/component": pool}},
        "spec": {"minReplicas": p.min_replicas, "maxReplicas": max(p.max_replicas, p.min_replicas + 1),
                 "metrics": metrics, "behavior": _behavior(p)},
    }


def cron_windows(schedule: Schedule) -> list[tuple[str, str, int]]:
    """(start, end, replicas) cron expressions for each step of the schedule, its period taken as 24 hours."""
    def at(offset: float) -> str:
        minute = round(offset / schedule.period_s * 24 * 60) % (24 * 60)
        return f"{minute % 60} {minute // 60} * * *"

    ends = [start for start, _ in schedule.steps[1:]] + [schedule.period_s]
    return [(at(start), at(end), replicas) for (start, replicas), end in zip(schedule.steps, ends)]


def scaled_object(pool: str, p: PoolPolicy, sync_s: float, namespace: str, prometheus_url: str) -> dict:
    assert p.schedule is not None
    selector = f'namespace="{namespace}",pod=~"kvrelay-{pool}-.*"'
    triggers = [{"type": "cron", "metadata": {"timezone": "Etc/UTC", "start": start, "end": end,
                                              "desiredReplicas": str(replicas)}}
                for start, end, replicas in cron_windows(p.schedule) if replicas > p.min_replicas]
    for name, value in p.targets.items():
        query = _POOL_QUERIES.get(name, "sum({series}{{{selector}}})").format(series=name, selector=selector)
        triggers.append({"type": "prometheus", "name": ADAPTER_NAMES[name],
                         "metadata": {"serverAddress": prometheus_url, "query": query, "threshold": _target(value)}})
    return {
        "apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
        "metadata": {"name": f"kvrelay-{pool}", "labels": {**_LABELS, "app.kubernetes.io/component": pool}},
        "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"kvrelay-{pool}"},
                 "pollingInterval": int(sync_s), "minReplicaCount": p.min_replicas,
                 "maxReplicaCount": max(p.max_replicas, p.min_replicas + 1),
                 "advanced": {"horizontalPodAutoscalerConfig": {"name": f"kvrelay-{pool}",
                                                                "behavior": _behavior(p)}},
                 "triggers": triggers},
    }


def engine_env(pool: str, budget: int, max_seqs: int) -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": f"kvrelay-{pool}"},
            "spec": {"template": {"spec": {"containers": [{"name": pool, "env": [
                {"name": "KVRELAY_MAX_NUM_BATCHED_TOKENS", "value": str(budget)},
                {"name": "KVRELAY_MAX_NUM_SEQS", "value": str(max_seqs)}]}]}}}}


def _delete(kind: str, api: str, pool: str = "prefill") -> dict:
    return {"$patch": "delete", "apiVersion": api, "kind": kind, "metadata": {"name": f"kvrelay-{pool}"}}


def write_overlay(out: str | Path, choice, policy: HPAPolicy, profile: Profile, deploy_k8s: Path = DEPLOY_K8S,
                  namespace: str = "default", prometheus_url: str = "http://prometheus-server.monitoring.svc:80"
                  ) -> list[Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    base = deploy_k8s / "overlays" / ("gpu" if profile.gpus_per_node else "cpu")
    sched = choice.spec.scheduler
    patches: dict[str, list[dict]] = {}
    resources: dict[str, list[dict]] = {}
    # One deletion per file: kustomize (v5.5) crashes on a file of several `$patch: delete` documents.
    pools = {"decode": policy.pools["colocated"]} if choice.spec.colocated else {
        pool: policy.pools[pool] for pool in ("prefill", "decode")}
    for pool, p in pools.items():
        patches[f"{pool}.yaml"] = [engine_env(pool, sched.max_num_batched_tokens, sched.max_num_seqs)]
        if p.schedule is None:
            patches[f"{pool}.yaml"].insert(0, hpa(pool, p, policy.sync_s))
        else:
            patches[f"no-{pool}-hpa.yaml"] = [_delete("HorizontalPodAutoscaler", "autoscaling/v2", pool)]
            resources[f"{pool}-scaledobject.yaml"] = [scaled_object(pool, p, policy.sync_s, namespace,
                                                                    prometheus_url)]
    if choice.spec.colocated:
        for kind, api in (("Deployment", "apps/v1"), ("Service", "v1"), ("HorizontalPodAutoscaler", "autoscaling/v2"),
                          ("PodDisruptionBudget", "policy/v1")):
            patches[f"no-prefill-{kind.lower()}.yaml"] = [_delete(kind, api)]
    written = []
    for name, docs in {**patches, **resources}.items():
        path = out / name
        path.write_text("\n---\n".join(json.dumps(d, indent=2) for d in docs) + "\n")
        written.append(path)
    shape = (f"{choice.spec.colocated} colocated" if choice.spec.colocated
             else f"{choice.spec.prefill} prefill + {choice.spec.decode} decode")
    kustomization = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                     "resources": [os.path.relpath(base, out), *resources], "patches": [{"path": n} for n in patches]}
    path = out / "kustomization.yaml"
    keda = ("# The ScaledObjects need KEDA in the cluster (deploy/README.md, Autoscaling).\n" if resources else "")
    path.write_text(f"# Written by `kvrelay plan` (profile {profile.name}): {shape} nodes at the peak, autoscaled.\n"
                    + keda + f"#   kubectl apply -k {out}\n" + json.dumps(kustomization, indent=2) + "\n")
    return [path, *written]
