"""The audit's HTML page: one trajectory token by token.

Prompt tokens and sampled tokens are told apart, sampled tokens are shaded by their rollout probability, and
every token a re-tokenizing pipeline would have changed is outlined with its drift kind (a re-render's insertion
is shown where it would go). Each turn's start (the first id it added to the prompt) is a marked line naming the
turn and its call, so a reader knows which request a drift is in; the head says the episode's reward, group and
labels, as the export gives them to its rows. Static HTML, no script: it renders anywhere, and a browser's DOM is
the test.
"""

from __future__ import annotations

import html
import math
from collections import Counter
from typing import Any

from tito_addon.records.record_reader import SessionFile
from tito_addon.records.rollout_groups import episode_views
from tito_addon.tools.drift_audit import CLASSES, BranchAudit

COLORS = {
    "bpe_resplit": "#d9480f",
    "special_token_collision": "#c2255c",
    "unicode_normalization": "#9c36b5",
    "eos_newline": "#1971c2",
    "template_kwarg": "#0c8599",
    "stripped_think": "#e03131",
    "tool_call_json": "#2f9e44",
    "whitespace": "#868e96",
    "template_other": "#5c940d",
}

STYLE = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #222; }
.trajectory { font-family: ui-monospace, monospace; font-size: 13px; line-height: 1.9; white-space: pre-wrap; }
.tok { padding: 1px 0; border-radius: 2px; }
.prompt { color: #555; }
.sampled { color: #000; }
.drift { outline: 2px solid var(--kind); outline-offset: -1px; }
.drift-insert { border-left: 3px solid var(--kind); padding: 0 2px; color: var(--kind); font-style: italic; }
.legend span { display: inline-block; margin-right: 14px; }
.turn-start { display: block; margin: 10px 0 2px; padding: 2px 6px; border-top: 2px solid #364fc7;
  background: #edf2ff; color: #364fc7; font: bold 12px system-ui, sans-serif; white-space: normal; }
#episode { font-size: 15px; }
.swatch { display: inline-block; width: 10px; height: 10px; margin-right: 4px; background: var(--kind); }
"""


def _token_text(tokenizer: Any, token: int) -> str:
    text = tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return text.replace("\n", "↵\n")


def render_page(session_file: SessionFile, audit: BranchAudit, tokenizer: Any) -> str:
    turns = {t.turn_id: t for t in session_file.turns}
    prompt, completion = session_file.full_ids()[audit.leaf_turn_id]
    ids = prompt + completion
    sampled: dict[int, float] = {}
    starts: dict[int, str] = {}
    node = turns[audit.leaf_turn_id]
    while True:
        for offset, logprob in enumerate(node.completion_logprobs):
            sampled[node.prompt_len + offset] = logprob
        starts[node.prompt_len - len(node.prompt_added_ids)] = _turn_start(node)
        if node.parent_turn_id is None:
            break
        node = turns[node.parent_turn_id]
    drift_at: dict[int, str] = {}
    inserts: dict[int, list[tuple[str, str]]] = {}
    for span in audit.spans:
        lo, hi = span.recorded
        if lo == hi:
            inserts.setdefault(lo, []).append((span.kind, span.rerendered_text))
        for position in range(lo, hi):
            drift_at[position] = span.kind
    parts = []
    for position, token in enumerate(ids):
        if position in starts:
            parts.append(starts[position])
        for kind, text in inserts.get(position, []):
            parts.append(_insert(kind, text))
        classes = ["tok", "sampled" if position in sampled else "prompt"]
        style = []
        attrs = f' data-pos="{position}" data-id="{token}"'
        if position in sampled:
            probability = math.exp(sampled[position])
            style.append(f"background: rgba(255, 196, 0, {0.15 + 0.75 * (1 - probability):.3f})")
            attrs += f' data-logprob="{sampled[position]:.4f}"'
        if position in drift_at:
            classes.append("drift")
            style.append(f"--kind: {COLORS[drift_at[position]]}")
            attrs += f' data-kind="{drift_at[position]}"'
        style_attr = f' style="{"; ".join(style)}"' if style else ""
        text = html.escape(_token_text(tokenizer, token))
        parts.append(f'<span class="{" ".join(classes)}"{attrs}{style_attr}>{text}</span>')
    for kind, text in inserts.get(len(ids), []):
        parts.append(_insert(kind, text))
    counts = Counter(span.kind for span in audit.spans)
    legend = "".join(
        f'<span style="--kind: {COLORS[k]}"><i class="swatch"></i>{k} ({counts.get(k, 0)})</span>' for k in CLASSES
    )
    title = f"tito audit: session {audit.session_id}, branch ending at turn {audit.leaf_turn_id}"
    summary = (
        f"{len(ids)} tokens, {len(sampled)} sampled (shaded: the less likely, the darker), "
        f"{sum(audit.per_turn.values())} a re-tokenizing pipeline would change"
    )
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
        f'<p id="episode">{html.escape(_episode_line(session_file, turns[audit.leaf_turn_id].episode_id))}</p>'
        f'<p id="summary">{html.escape(summary)}</p><p class="legend">{legend}</p>'
        f'<div class="trajectory" id="trajectory">{"".join(parts)}</div></body></html>'
    )


def _insert(kind: str, text: str) -> str:
    shown = html.escape(text.replace("\n", "↵"))
    return f'<span class="drift-insert" data-kind="{kind}" style="--kind: {COLORS[kind]}">+{shown}</span>'


def _turn_start(turn: Any) -> str:
    label = (f"turn {turn.turn_id} · {turn.call} · +{len(turn.prompt_added_ids)} prompt ids, "
             f"{len(turn.completion_ids)} sampled · {turn.finish_reason or '-'}")  # fmt: skip
    return (f'<span class="turn-start" id="turn-{turn.turn_id}" data-turn="{turn.turn_id}" '
            f'data-call="{html.escape(turn.call)}">{html.escape(label)}</span>')  # fmt: skip


def _episode_line(session_file: SessionFile, episode: str) -> str:
    """What the branch's episode is scored and grouped as (the export's view of its annotations)."""
    for view in episode_views([session_file]):
        if view.episode == episode:
            notes = view.notes
            reward = f"reward {notes.reward:g}" if notes.reward is not None else "no reward"
            labels = ("labels " + ", ".join(notes.labels)) if notes.labels else "no labels"
            return f"episode {episode}: {reward}, group {view.group}, {labels}"
    return f"episode {episode}"
