"""The kustomize overlay `kvrelay plan --out DIR` writes: deploy/k8s with the planned pools.

It builds on deploy/k8s/overlays/gpu (GPU profiles) or overlays/cpu (a CPU profile) and patches, in the
conventions of deploy/ (strategic-merge patches by path; tunables as KVRELAY_<FLAG> environment variables;
the HPAs own the replica counts):
- each pool's HorizontalPodAutoscaler: minReplicas, maxReplicas, its Pods metrics and targets (served by the
  Prometheus adapter rules of deploy/k8s/base), and the behaviour the planner simulated;
- each pool's engine budget (KVRELAY_MAX_NUM_BATCHED_TOKENS, KVRELAY_MAX_NUM_SEQS).
A colocated plan deletes the prefill pool (`$patch: delete`: its Deployment, Service, HPA and disruption
budget): the decode pods prefill everything themselves.
The files are YAML written as JSON (a subset of YAML), so that writing them needs no YAML library.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvrelay.sim.autoscale import HPAPolicy, PoolPolicy
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


def hpa(pool: str, p: PoolPolicy, sync_s: float) -> dict:
    metrics = [{"type": "Pods", "pods": {"metric": {"name": ADAPTER_NAMES[name]},
                                         "target": {"type": "AverageValue", "averageValue": _target(value)}}}
               for name, value in p.targets.items()]
    return {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": f"kvrelay-{pool}", "labels": {**_LABELS, "app.kubernetes.io/component": pool}},
        "spec": {
            "minReplicas": p.min_replicas, "maxReplicas": max(p.max_replicas, p.min_replicas + 1), "metrics": metrics,
            "behavior": {
                "scaleUp": {"stabilizationWindowSeconds": 0,
                            "policies": [{"type": "Pods", "value": p.up_pods, "periodSeconds": int(p.up_period_s)}]},
                "scaleDown": {"stabilizationWindowSeconds": int(p.down_window_s),
                              "policies": [{"type": "Pods", "value": p.down_pods,
                                            "periodSeconds": int(p.down_period_s)}]}},
        },
    }


def engine_env(pool: str, budget: int, max_seqs: int) -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": f"kvrelay-{pool}"},
            "spec": {"template": {"spec": {"containers": [{"name": pool, "env": [
                {"name": "KVRELAY_MAX_NUM_BATCHED_TOKENS", "value": str(budget)},
                {"name": "KVRELAY_MAX_NUM_SEQS", "value": str(max_seqs)}]}]}}}}


def _delete(kind: str, api: str) -> dict:
    return {"$patch": "delete", "apiVersion": api, "kind": kind, "metadata": {"name": "kvrelay-prefill"}}


def write_overlay(out: str | Path, choice, policy: HPAPolicy, profile: Profile, deploy_k8s: Path = DEPLOY_K8S
                  ) -> list[Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    base = deploy_k8s / "overlays" / ("gpu" if profile.gpus_per_node else "cpu")
    sched = choice.spec.scheduler
    patches: dict[str, list[dict]] = {}
    if choice.spec.colocated:
        decode = policy.pools["colocated"]
        patches["decode.yaml"] = [hpa("decode", decode, policy.sync_s),
                                  engine_env("decode", sched.max_num_batched_tokens, sched.max_num_seqs)]
        # One deletion per file: kustomize (v5.5) crashes on a file of several `$patch: delete` documents.
        for kind, api in (("Deployment", "apps/v1"), ("Service", "v1"), ("HorizontalPodAutoscaler", "autoscaling/v2"),
                          ("PodDisruptionBudget", "policy/v1")):
            patches[f"no-prefill-{kind.lower()}.yaml"] = [_delete(kind, api)]
    else:
        for pool in ("prefill", "decode"):
            patches[f"{pool}.yaml"] = [hpa(pool, policy.pools[pool], policy.sync_s),
                                       engine_env(pool, sched.max_num_batched_tokens, sched.max_num_seqs)]
    written = []
    for name, docs in patches.items():
        path = out / name
        path.write_text("\n---\n".join(json.dumps(d, indent=2) for d in docs) + "\n")
        written.append(path)
    shape = (f"{choice.spec.colocated} colocated" if choice.spec.colocated
             else f"{choice.spec.prefill} prefill + {choice.spec.decode} decode")
    kustomization = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                     "resources": [os.path.relpath(base, out)], "patches": [{"path": n} for n in patches]}
    path = out / "kustomization.yaml"
    path.write_text(f"# Written by `kvrelay plan` (profile {profile.name}): {shape} nodes at the peak, autoscaled.\n"
                    f"#   kubectl apply -k {out}\n" + json.dumps(kustomization, indent=2) + "\n")
    return [path, *written]
