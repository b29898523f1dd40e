"""Writes grafana/dashboards/numwatch.json, the numwatch dashboard (Grafana's classic JSON model).

The JSON is generated so panels stay uniform (datasource, variables, grid) and so the end-to-end
test can read every expression back; edit the panel list here and run
``python grafana/build_dashboard.py``. tests/test_grafana_e2e.py fails if the committed JSON
differs from what this script writes, and runs every expression against a real Prometheus.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "dashboards" / "numwatch.json"
UID = "numwatch-training"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'job=~"$job", rank=~"$rank"'  # every query is scoped by these
LAYER = SEL + ', layer=~"$layer"'  # and attention queries by the layer too
BY = "job, rank"  # keep runs and ranks apart in every aggregation


def target(expr: str, legend: str, ref: str = "A", *, instant: bool = False) -> dict[str, Any]:
    t = {
        "datasource": DATASOURCE,
        "expr": expr,
        "legendFormat": legend,
        "range": not instant,
        "instant": instant,
        "refId": ref,
    }
    if instant:
        t["format"] = "table"
    return t


def timeseries(
    title: str,
    description: str,
    targets: list[dict[str, Any]],
    *,
    unit: str = "short",
    log: bool = False,
    stack: bool = False,
) -> dict[str, Any]:
    custom: dict[str, Any] = {
        "drawStyle": "line",
        "lineWidth": 1,
        "fillOpacity": 10 if stack else 0,
        "showPoints": "never",
        "spanNulls": True,
    }
    if log:
        custom["scaleDistribution"] = {"type": "log", "log": 10}
    if stack:
        custom["stacking"] = {"mode": "normal", "group": "A"}
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "targets": targets,
        "fieldConfig": {"defaults": {"unit": unit, "custom": custom}, "overrides": []},
        "options": {
            "legend": {
                "displayMode": "table",
                "placement": "right",
                "calcs": ["lastNotNull", "max"],
            },
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
    }


def stat(title: str, description: str, expr: str, *, unit: str = "short") -> dict[str, Any]:
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "targets": [target(expr, "{{job}} rank {{rank}}")],
        "fieldConfig": {"defaults": {"unit": unit, "decimals": 3}, "overrides": []},
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "textMode": "auto",
        },
    }


def heatmap(title: str, description: str, expr: str, legend: str) -> dict[str, Any]:
    return {
        "type": "heatmap",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "targets": [target(expr, legend)],
        "fieldConfig": {"defaults": {}, "overrides": []},
        "options": {
            "calculate": False,  # each series (layer, head) is one row of cells
            "cellGap": 1,
            "color": {"mode": "scheme", "scheme": "Oranges", "steps": 64, "exponent": 0.5},
            "yAxis": {"axisPlacement": "left"},
            "rowsFrame": {"layout": "auto"},
            "tooltip": {"mode": "single", "yHistogram": False},
            "legend": {"show": True},
        },
    }


def table(title: str, description: str, expr: str) -> dict[str, Any]:
    return {
        "type": "table",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "targets": [target(expr, "", instant=True)],
        "fieldConfig": {"defaults": {}, "overrides": []},
        "options": {"showHeader": True, "sortBy": [{"displayName": "metric", "desc": False}]},
        "transformations": [
            {
                "id": "organize",
                "options": {
                    "excludeByName": {"Time": True, "__name__": True, "instance": True},
                    "renameByName": {"Value": "worst head"},
                },
            }
        ],
    }


def row(title: str) -> dict[str, Any]:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


def by_layer(agg: str, metric: str) -> str:
    return f"{agg} by ({BY}, layer) (numwatch_{metric}{{{LAYER}}})"


def top10(label: str, metric: str) -> str:
    """The 10 largest series of ``metric`` by ``label`` (param or module) at each instant."""
    return f"topk(10, max by ({BY}, {label}) (numwatch_{metric}{{{SEL}}}))"


LEGEND_LAYER = "{{layer}} r{{rank}} {{job}}"
LEGEND_RUN = "{{job}} rank {{rank}}"

# (panel, width, height) per row; the grid is filled left to right, 24 columns wide.
SECTIONS: list[tuple[str, list[tuple[dict[str, Any], int, int]]]] = [
    (
        "Overview",
        [
            (
                stat(
                    "Step",
                    "Last step of the latest flush.",
                    f"max by ({BY}) (numwatch_step{{{SEL}}})",
                ),
                4,
                4,
            ),
            (stat("Loss", "Last loss passed to Monitor.step().", f"numwatch_loss{{{SEL}}}"), 4, 4),
            (
                stat(
                    "Non-finite elements",
                    "NaN/Inf gradient and activation elements in the latest flush window.",
                    f'sum by ({BY}) ({{__name__=~"numwatch_(grad|activation)_nonfinite", {SEL}}})',
                ),
                4,
                4,
            ),
            (
                stat(
                    "Events",
                    "Events found since the monitor was made (all kinds and rules).",
                    f"sum by ({BY}) (numwatch_events_total{{{SEL}}})",
                ),
                4,
                4,
            ),
            (
                stat(
                    "Skipped steps",
                    "Optimizer steps the skip_step action skipped since the monitor was made.",
                    f"max by ({BY}) (numwatch_mitigation_skipped_steps_total{{{SEL}}})",
                ),
                4,
                4,
            ),
            (
                stat(
                    "Monitor overhead",
                    "numwatch's host time per step as a fraction of the step time.",
                    f"numwatch_monitor_overhead_seconds{{{SEL}}} / numwatch_step_seconds{{{SEL}}}",
                    unit="percentunit",
                ),
                4,
                4,
            ),
            (
                timeseries(
                    "Loss",
                    "The loss of each flush's last step, and the largest and the mean over "
                    "the steps since the previous flush (a spike between two flushes shows in "
                    "the largest).",
                    [
                        target(f"numwatch_loss{{{SEL}}}", "last " + LEGEND_RUN),
                        target(f"numwatch_loss_max{{{SEL}}}", "max " + LEGEND_RUN, "B"),
                        target(f"numwatch_loss_mean{{{SEL}}}", "mean " + LEGEND_RUN, "C"),
                    ],
                    log=True,
                ),
                24,
                7,
            ),
        ],
    ),
    (
        "Attention precursors (per layer: the worst head)",
        [
            (
                timeseries(
                    "Repeated-max rows",
                    "Fraction of softmax rows whose maximum logit is attained at least twice "
                    "(the trigger of biased low-precision rounding); worst head of each layer.",
                    [target(by_layer("max", "attn_repeated_max_fraction"), LEGEND_LAYER)],
                    unit="percentunit",
                ),
                8,
                8,
            ),
            (
                timeseries(
                    "Saturated rows",
                    "Fraction of rows with two or more entries that round to P = 1 in the "
                    "kernel's P dtype; worst head of each layer.",
                    [target(by_layer("max", "attn_saturated_fraction"), LEGEND_LAYER)],
                    unit="percentunit",
                ),
                8,
                8,
            ),
            (
                timeseries(
                    "Max attention logit",
                    "Largest attention logit per layer (log scale); runs past 1e4 diverged "
                    "(Wortsman et al. 2023).",
                    [target(by_layer("max", "attn_max_logit"), LEGEND_LAYER)],
                    log=True,
                ),
                8,
                8,
            ),
            (
                timeseries(
                    "Attention output bias and systematic error",
                    "mean(err)/mean|err| of the attention output against an fp32 recomputation "
                    "(the exporter's default heads: layer serves the head of largest magnitude, "
                    "with its sign; with heads: top_k or all, the max and min over them): a "
                    "persistent sign is the biased rounding of the paper. Systematic error "
                    "(largest head): the error beyond correct rounding that keeps one sign per "
                    "output dim, relative to the whole error; about 1 when the kernel is "
                    "biased, whatever the signs of V.",
                    [
                        target(by_layer("max", "attn_output_bias"), "max " + LEGEND_LAYER),
                        target(by_layer("min", "attn_output_bias"), "min " + LEGEND_LAYER, "B"),
                        target(
                            by_layer("max", "attn_output_systematic_error"),
                            "systematic " + LEGEND_LAYER,
                            "C",
                        ),
                    ],
                ),
                8,
                8,
            ),
            (
                timeseries(
                    "Softmax entropy (lowest head mean)",
                    "Mean softmax-row entropy of the layer's lowest head (nats); a collapse "
                    "towards 0 means one-hot attention. (The per-row minimum, attn_entropy_min, "
                    "is 0 in any causal layer: its first row has one key.)",
                    [target(by_layer("min", "attn_entropy_mean"), LEGEND_LAYER)],
                ),
                8,
                8,
            ),
            (
                table(
                    "Worst head per layer",
                    "Index of the worst head of each layer, per precursor metric.",
                    f"numwatch_worst_head{{{LAYER}, metric=~"
                    '"attn_repeated_max_fraction|attn_saturated_fraction|attn_max_logit'
                    '|attn_output_bias"}',
                ),
                8,
                8,
            ),
            (
                heatmap(
                    "Max logit, layers x heads",
                    "Max attention logit per (layer, head) over time. Default exporter mode "
                    "shows one row per layer (its worst head); sinks.prometheus.heads = 'top_k' "
                    "or 'all' fills in the heads.",
                    f"max by (layer, head) (numwatch_attn_max_logit{{{LAYER}}})",
                    "{{layer}} h{{head}}",
                ),
                24,
                10,
            ),
        ],
    ),
    (
        "Spectral norms",
        [
            (
                timeseries(
                    "Weight spectral norm (top 10)",
                    "Largest singular value of 2-D weights (warm-started power iteration).",
                    [
                        target(
                            top10("param", "weight_spectral_norm"),
                            "{{param}} r{{rank}}",
                        )
                    ],
                ),
                8,
                8,
            ),
            (
                timeseries(
                    "W_Q / W_K spectral norm (largest head)",
                    "Per-head spectral norms of the query and key projections; their growth "
                    "precedes logit growth.",
                    [
                        target(by_layer("max", "attn_q_spectral_norm"), "Q " + LEGEND_LAYER),
                        target(by_layer("max", "attn_k_spectral_norm"), "K " + LEGEND_LAYER, "B"),
                    ],
                ),
                8,
                8,
            ),
            (
                timeseries(
                    "QK logit bound (largest head)",
                    "sigma(W_Q) sigma(W_K) / sqrt(head_dim): an upper bound of the logit per "
                    "unit-norm input.",
                    [target(by_layer("max", "attn_qk_logit_bound"), LEGEND_LAYER)],
                    log=True,
                ),
                8,
                8,
            ),
        ],
    ),
    (
        "Gradients and activations",
        [
            (
                timeseries(
                    "Gradient norm",
                    "Global L2 norm of the last step's gradients, and the window's largest.",
                    [
                        target(f"numwatch_grad_norm{{{SEL}}}", "last " + LEGEND_RUN),
                        target(f"numwatch_grad_norm_max{{{SEL}}}", "max " + LEGEND_RUN, "B"),
                    ],
                    log=True,
                ),
                8,
                8,
            ),
            (
                timeseries(
                    "Gradient absmax (top 10 parameters)",
                    "Largest finite |gradient| per parameter.",
                    [
                        target(
                            top10("param", "grad_absmax"),
                            "{{param}} r{{rank}}",
                        )
                    ],
                    log=True,
                ),
                8,
                8,
            ),
            (
                timeseries(
                    "Activation absmax (top 10 modules)",
                    "Largest finite |output| per module (sampled forwards).",
                    [
                        target(
                            top10("module", "activation_absmax"),
                            "{{module}} r{{rank}}",
                        )
                    ],
                    log=True,
                ),
                8,
                8,
            ),
            (
                timeseries(
                    "Headroom to overflow",
                    "absmax / largest finite value of the dtype, worst parameter and module "
                    "(1 = at overflow).",
                    [
                        target(
                            f"max by ({BY}) (numwatch_grad_headroom{{{SEL}}})",
                            "gradients " + LEGEND_RUN,
                        ),
                        target(
                            f"max by ({BY}) (numwatch_activation_headroom{{{SEL}}})",
                            "activations " + LEGEND_RUN,
                            "B",
                        ),
                    ],
                    unit="percentunit",
                    log=True,
                ),
                8,
                8,
            ),
            (
                timeseries(
                    "Gradient underflow (top 10 parameters)",
                    "Fraction of non-zero finite gradient values below the smallest normal of "
                    "the underflow dtype.",
                    [
                        target(
                            top10("param", "grad_underflow_fraction"),
                            "{{param}} r{{rank}}",
                        )
                    ],
                    unit="percentunit",
                ),
                8,
                8,
            ),
            (
                timeseries(
                    "Activation underflow (top 10 modules)",
                    "Fraction of non-zero finite outputs below the smallest normal of the "
                    "underflow dtype.",
                    [
                        target(
                            top10("module", "activation_underflow_fraction"),
                            "{{module}} r{{rank}}",
                        )
                    ],
                    unit="percentunit",
                ),
                8,
                8,
            ),
        ],
    ),
    (
        "Optimizer",
        [
            (
                timeseries(
                    "Update / weight ratio (top 10 parameters)",
                    "RMS(update) / RMS(weight) of the last measured optimizer step "
                    "(optimizer.every); ~1e-3 is typical, far above means a violent update.",
                    [target(top10("param", "optimizer_update_ratio"), "{{param}} r{{rank}}")],
                    log=True,
                ),
                8,
                8,
            ),
            (
                timeseries(
                    "Absorbed updates (top 10 parameters)",
                    "Fraction of elements with a non-zero gradient whose weight did not move: "
                    "updates below half an ULP of a low-precision weight are rounded away.",
                    [target(top10("param", "optimizer_absorbed_fraction"), "{{param}} r{{rank}}")],
                    unit="percentunit",
                ),
                8,
                8,
            ),
            (
                timeseries(
                    "Learning rate and loss scale",
                    "Learning rate per parameter group; GradScaler's loss scale (with "
                    "attach(optimizer, scaler=...)) and its drops (overflow steps).",
                    [
                        target(f"numwatch_optimizer_lr{{{SEL}}}", "lr group {{group}} r{{rank}}"),
                        target(f"numwatch_loss_scale{{{SEL}}}", "loss scale " + LEGEND_RUN, "B"),
                        target(
                            f"numwatch_loss_scale_drops_total{{{SEL}}}",
                            "scale drops " + LEGEND_RUN,
                            "C",
                        ),
                    ],
                    log=True,
                ),
                8,
                8,
            ),
        ],
    ),
    (
        "Non-finite values, events and mitigation",
        [
            (
                timeseries(
                    "Non-finite elements",
                    "NaN/Inf elements of gradients and activations per flush window.",
                    [
                        target(
                            f"sum by ({BY}) (numwatch_grad_nonfinite{{{SEL}}})",
                            "gradients " + LEGEND_RUN,
                        ),
                        target(
                            f"sum by ({BY}) (numwatch_activation_nonfinite{{{SEL}}})",
                            "activations " + LEGEND_RUN,
                            "B",
                        ),
                    ],
                ),
                8,
                8,
            ),
            (
                timeseries(
                    "Events (since the monitor was made)",
                    "Events found by kind and rule (counters).",
                    [
                        target(
                            f"sum by ({BY}, kind, rule) (numwatch_events_total{{{SEL}}})",
                            "{{kind}}/{{rule}} r{{rank}}",
                        )
                    ],
                    stack=True,
                ),
                8,
                8,
            ),
            (
                timeseries(
                    "numwatch attention kernel",
                    "stabilized: the share of the layer's attention calls that ran numwatch's "
                    "stabilized kernel (swapped in by a rule or by Monitor.swap_attention; 0 "
                    "where every call fell back to SDPA: dropout, fp32). The mode series gives "
                    "that share for the mode a routed layer's kernel runs (plain, stabilized, "
                    "paper_repro for reproductions, _split with split_sum); a layer on native "
                    "attention has none.",
                    [
                        target(
                            by_layer("max", "attn_kernel_stabilized"),
                            "stabilized " + LEGEND_LAYER,
                        ),
                        target(
                            f"max by ({BY}, layer, mode) (numwatch_attn_kernel_mode{{{LAYER}}})",
                            "{{mode}} {{layer}} r{{rank}} {{job}}",
                            "B",
                        ),
                    ],
                ),
                8,
                8,
            ),
            (
                timeseries(
                    "Attention kernel fallbacks",
                    "Calls routed to numwatch's kernel that it handed to native SDPA, by reason "
                    "(dtype: not bf16/fp16; dropout; mask; head_dim; ...), counted since the "
                    "process imported numwatch.",
                    [
                        target(
                            f"sum by ({BY}, reason) "
                            f"(numwatch_attn_kernel_fallbacks_total{{{SEL}}})",
                            "{{reason}} r{{rank}} {{job}}",
                        )
                    ],
                ),
                8,
                8,
            ),
            (
                timeseries(
                    "Skipped optimizer steps",
                    "Steps the skip_step action skipped since the monitor was made.",
                    [
                        target(
                            f"max by ({BY}) (numwatch_mitigation_skipped_steps_total{{{SEL}}})",
                            LEGEND_RUN,
                        )
                    ],
                ),
                8,
                8,
            ),
            (
                timeseries(
                    "Learning-rate factor",
                    "Factor the lr_backoff action applies to the learning rate (1 = none).",
                    [
                        target(
                            f"min by ({BY}) (numwatch_mitigation_lr_factor{{{SEL}}})",
                            LEGEND_RUN,
                        )
                    ],
                ),
                8,
                8,
            ),
        ],
    ),
    (
        "Monitor",
        [
            (
                timeseries(
                    "Step time and monitor overhead",
                    "Wall time per step, and numwatch's host time per step.",
                    [
                        target(f"numwatch_step_seconds{{{SEL}}}", "step " + LEGEND_RUN),
                        target(
                            f"numwatch_monitor_overhead_seconds{{{SEL}}}",
                            "numwatch " + LEGEND_RUN,
                            "B",
                        ),
                    ],
                    unit="s",
                ),
                12,
                8,
            ),
            (
                timeseries(
                    "Monitor errors",
                    "Failures of components since the monitor was made (training goes on).",
                    [
                        target(
                            f"sum by ({BY}, component) (numwatch_monitor_errors_total{{{SEL}}})",
                            "{{component}} r{{rank}}",
                        )
                    ],
                ),
                12,
                8,
            ),
        ],
    ),
]


def variables() -> list[dict[str, Any]]:
    def query(name: str, label: str, expr: str) -> dict[str, Any]:
        return {
            "type": "query",
            "name": name,
            "label": label,
            "datasource": DATASOURCE,
            "definition": expr,
            "query": {"query": expr, "refId": f"numwatch-{name}"},
            "refresh": 2,  # on time-range change: new runs and ranks appear
            "multi": True,
            "includeAll": True,
            "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "sort": 3,
            "regex": "",
            "hide": 0,
        }

    return [
        {
            "type": "datasource",
            "name": "datasource",
            "label": "Prometheus",
            "query": "prometheus",
            "current": {
                "selected": True,
                "text": "numwatch-prometheus",
                "value": "numwatch-prometheus",
            },
            "regex": "",
            "refresh": 1,
            "hide": 0,
        },
        query("job", "Job", "label_values(numwatch_run_info, job)"),
        query("rank", "Rank", 'label_values(numwatch_run_info{job=~"$job"}, rank)'),
        query(
            "layer", "Layer", 'label_values(numwatch_attn_calls{job=~"$job", rank=~"$rank"}, layer)'
        ),
    ]


def dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    y = 0
    for title, items in SECTIONS:
        panels.append({**row(title), "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        y += 1
        x, line_height = 0, 0
        for panel, w, h in items:
            if x + w > 24:
                x, y, line_height = 0, y + line_height, 0
            panels.append({**panel, "gridPos": {"h": h, "w": w, "x": x, "y": y}})
            x += w
            line_height = max(line_height, h)
        y += line_height
    for i, panel in enumerate(panels, start=1):
        panel["id"] = i
    return {
        "uid": UID,
        "title": "numwatch: training numerics",
        "description": "Numerical health of training runs monitored by numwatch "
        "(README, 'Prometheus' and 'Grafana').",
        "tags": ["numwatch", "training"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 41,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "links": [],
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "templating": {"list": variables()},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(render())
    print(f"wrote {OUT}")
