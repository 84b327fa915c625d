#!/usr/bin/env python3
"""Writes the Grafana dashboards (megatrain-box.json, megatrain-job.json) from the panel
lists below: edit here, run `python3 dashboards/generate.py`, commit both.

Every panel's PromQL uses the dashboard variables $datasource, $gpu, $user and $job;
tests/e2e/test_metrics.py runs each expression against a real Prometheus scraping a real
megatraind and requires data from all of them.
"""
import json
import os

DS = {"type": "prometheus", "uid": "${datasource}"}
# The panels of DPO jobs' metrics begin so (tests/e2e/test_metrics.py runs a DPO job for them).
DPO_PANEL_PREFIX = "Preference (DPO): "


def variable(name, label, query):
    return {
        "name": name, "label": label, "type": "query", "datasource": DS,
        "query": {"query": query, "refId": name}, "definition": query,
        "includeAll": True, "allValue": ".*", "multi": True, "refresh": 2, "sort": 1,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
    }


def templating():
    return {"list": [
        {"name": "datasource", "label": "Prometheus", "type": "datasource",
         "query": "prometheus", "current": {}, "hide": 0},
        variable("gpu", "GPU", "label_values(megatrain_build_info, gpu)"),
        variable("user", "User", "label_values(megatrain_user_jobs, user)"),
        variable("job", "Job", 'label_values(megatrain_job_step{user=~"$user"}, job)'),
    ]}


def panel(pid, title, exprs, unit, x, y, w=12, h=8, kind="timeseries", description=""):
    targets = [{"datasource": DS, "expr": e, "legendFormat": legend, "refId": chr(65 + i)}
               for i, (e, legend) in enumerate(exprs)]
    p = {"id": pid, "type": kind, "title": title, "description": description,
         "datasource": DS, "gridPos": {"x": x, "y": y, "w": w, "h": h}, "targets": targets,
         "fieldConfig": {"defaults": {"unit": unit}, "overrides": []}, "options": {}}
    if kind == "timeseries":
        p["fieldConfig"]["defaults"]["custom"] = {"lineWidth": 1, "fillOpacity": 10}
    return p


def dashboard(uid, title, panels):
    return {"uid": uid, "title": title, "tags": ["megatrain"], "timezone": "browser",
            "schemaVersion": 39, "version": 1, "editable": True, "refresh": "10s",
            "time": {"from": "now-1h", "to": "now"}, "templating": templating(),
            "annotations": {"list": []}, "panels": panels}


def box():
    g = '{gpu=~"$gpu"}'
    u = '{user=~"$user"}'
    layout = [
        ("Jobs by state", [("sum by (state) (megatrain_jobs)", "{{state}}")], "short"),
        ("Queue depth", [("megatrain_queue_depth", "queued")], "short"),
        ("Running and queued jobs per user",
         [(f"sum by (user, state) (megatrain_user_jobs{u})", "{{user}} {{state}}")], "short"),
        ("Tokens per second per user",
         [(f"sum by (user) (megatrain_tokens_per_second{u})", "{{user}}")], "short"),
        ("Stream utilisation per GPU",
         [(f"sum by (gpu, stream) (rate(megatrain_stream_busy_seconds_total{g}[$__rate_interval]))",
           "gpu {{gpu}} {{stream}}")], "percentunit"),
        ("PCIe bandwidth per GPU",
         [(f"sum by (gpu, direction) (rate(megatrain_pcie_bytes_total{g}[$__rate_interval]))",
           "gpu {{gpu}} {{direction}}")], "Bps"),
        ("Device memory used per GPU",
         [(f"sum by (gpu) (megatrain_device_memory_used_bytes{g})", "gpu {{gpu}} used"),
          (f"max by (gpu) (megatrain_device_memory_peak_bytes{g})", "gpu {{gpu}} peak")], "bytes"),
        ("Host memory held by jobs",
         [(f"sum by (kind) (megatrain_host_store_bytes{g})", "{{kind}}")], "bytes"),
        ("MFU per GPU", [(f"max by (gpu) (megatrain_mfu_ratio{g})", "gpu {{gpu}}")], "percentunit"),
        ("GEMM peak (MFU's denominator)", [(f"megatrain_peak_tflops{g}", "gpu {{gpu}}")], "short"),
        ("Fair share: recent device time per user",
         [(f"megatrain_user_device_seconds{u}", "{{user}}")], "s"),
        ("Jobs waiting (limits, memory) and preemptions",
         [("megatrain_jobs_waiting", "waiting"),
          ("sum(increase(megatrain_preemptions_total[$__range])) or vector(0)",
           "preempted in range")], "short"),
        ("Daemon CPU", [("rate(process_cpu_seconds_total[$__rate_interval])", "cores")], "short"),
        ("Daemon memory and files",
         [("process_resident_memory_bytes", "resident"),
          ("process_open_fds", "open fds")], "short"),
    ]
    panels = [panel(i + 1, t, e, unit, 12 * (i % 2), 8 * (i // 2)) for i, (t, e, unit) in enumerate(layout)]
    return dashboard("megatrain-box", "megatrain: the box", panels)


def job():
    j = '{job=~"$job"}'
    layout = [
        ("Loss", [(f"megatrain_loss{j}", "train, job {{job}}"),
                  (f"megatrain_eval_loss{j}", "eval, job {{job}}")], "short"),
        ("Progress", [(f"megatrain_job_step{j} / megatrain_job_total_steps{j}", "job {{job}}")],
         "percentunit"),
        ("Tokens per second", [(f"megatrain_tokens_per_second{j}", "job {{job}}")], "short"),
        ("Model TFLOP/s and MFU",
         [(f"megatrain_model_tflops{j}", "job {{job}} TFLOP/s"),
          (f"megatrain_mfu_ratio{j}", "job {{job}} MFU")], "short"),
        ("Stream utilisation",
         [(f"rate(megatrain_stream_busy_seconds_total{j}[$__rate_interval])",
           "job {{job}} {{stream}}")], "percentunit"),
        ("CPU AdamW in the step, over its rate alone (the planner's adamw_in_step_fraction)",
         [(f"megatrain_optimizer_in_step_fraction{j}", "job {{job}}")], "percentunit"),
        ("CPU AdamW parameters per second in the step",
         [(f"megatrain_optimizer_params_per_second{j}", "job {{job}}")], "short"),
        ("PCIe bandwidth",
         [(f"rate(megatrain_pcie_bytes_total{j}[$__rate_interval])", "job {{job}} {{direction}}"),
          (f"megatrain_pcie_transfer_rate_bytes_per_second{j}",
           "job {{job}} {{direction}} while copying")], "Bps"),
        ("Step time",
         [(f"histogram_quantile(0.5, sum by (job, le) (rate(megatrain_step_duration_seconds_bucket{j}[$__rate_interval])))",
           "job {{job}} p50"),
          (f"histogram_quantile(0.95, sum by (job, le) (rate(megatrain_step_duration_seconds_bucket{j}[$__rate_interval])))",
           "job {{job}} p95"),
          (f"rate(megatrain_step_duration_seconds_sum{j}[$__rate_interval]) / rate(megatrain_step_duration_seconds_count{j}[$__rate_interval])",
           "job {{job}} mean")], "s"),
        ("Gradient norm and learning rate",
         [(f"megatrain_grad_norm{j}", "job {{job}} grad norm"),
          (f"megatrain_learning_rate{j}", "job {{job}} lr")], "short"),
        ("Checkpoints",
         [(f"megatrain_checkpoint_duration_seconds_sum{j} / megatrain_checkpoint_duration_seconds_count{j}",
           "job {{job}} mean seconds"),
          (f"megatrain_checkpoint_duration_seconds_count{j}", "job {{job}} written"),
          (f"megatrain_checkpoint_bytes_total{j}", "job {{job}} bytes"),
          (f"megatrain_checkpoint_wait_seconds_total{j}", "job {{job}} seconds waited")], "short"),
        ("Memory",
         [(f"megatrain_device_memory_used_bytes{j}", "job {{job}} device"),
          (f"megatrain_device_memory_peak_bytes{j}", "job {{job}} device peak"),
          (f"megatrain_host_store_bytes{j}", "job {{job}} host {{kind}}")], "bytes"),
        # DPO jobs alone (docs/dpo.md): TRL's step metrics.
        (DPO_PANEL_PREFIX + "rewards",
         [(f"megatrain_dpo_rewards_accuracies{j}", "job {{job}} rewards/accuracies"),
          (f"megatrain_dpo_rewards_margins{j}", "job {{job}} rewards/margins"),
          (f"megatrain_dpo_rewards_chosen{j}", "job {{job}} rewards/chosen"),
          (f"megatrain_dpo_rewards_rejected{j}", "job {{job}} rewards/rejected")], "short"),
        (DPO_PANEL_PREFIX + "log-probabilities",
         [(f"megatrain_dpo_logps_chosen{j}", "job {{job}} logps/chosen"),
          (f"megatrain_dpo_logps_rejected{j}", "job {{job}} logps/rejected")], "short"),
        # ... and on their eval pairs (an eval set), at each evaluation.
        (DPO_PANEL_PREFIX + "eval pairs",
         [(f"megatrain_eval_dpo_rewards_accuracies{j}", "job {{job}} eval rewards/accuracies"),
          (f"megatrain_eval_dpo_rewards_margins{j}", "job {{job}} eval rewards/margins"),
          (f"megatrain_eval_loss{j}", "job {{job}} eval loss")], "short"),
    ]
    panels = [panel(i + 1, t, e, unit, 12 * (i % 2), 8 * (i // 2)) for i, (t, e, unit) in enumerate(layout)]
    return dashboard("megatrain-job", "megatrain: one job", panels)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    for name, d in (("megatrain-box.json", box()), ("megatrain-job.json", job())):
        with open(os.path.join(here, name), "w") as f:
            json.dump(d, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
