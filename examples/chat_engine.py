"""Multi-turn chat through prefixkv's example engine, with prefix caching on and off.

A tiny random-weight Llama runs on the CPU (torch reference attention; on a GPU the same
engine calls the Triton kernels). Each turn re-sends the whole conversation, so with
caching every turn after the first recomputes only the new message. The replies must be
identical either way; only the prefill work and time differ.

Time to first token is measured as ``prefixkv bench`` measures it: per turn, process CPU
time from the turn's start to the end of its last prefill step, with one torch thread on
the CPU (wall-clock time flips under load on a shared machine; CPU time does not).

    python examples/chat_engine.py [--conversations 4] [--turns 3] [--device cpu]
"""

from __future__ import annotations

import argparse
import time

import torch

from prefixkv.bench.e2e import turn_ttfts
from prefixkv.engine import LlamaConfig, SamplingParams, build_engine, run_chat, synthetic_conversations


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=4, help="chats run side by side")
    ap.add_argument("--turns", type=int, default=3, help="turns per chat")
    ap.add_argument("--message-len", type=int, default=24, help="tokens of each user message")
    ap.add_argument("--system-len", type=int, default=96, help="tokens of the shared system prompt")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens generated per reply")
    ap.add_argument("--num-blocks", type=int, default=128, help="KV blocks in the pool (16 tokens each)")
    ap.add_argument("--device", default="cpu", help="torch device (cuda: the Triton kernels)")
    args = ap.parse_args(argv)

    config = LlamaConfig(num_layers=2)
    system = list(range(1, args.system_len + 1))
    convs = synthetic_conversations(args.conversations, args.turns, args.message_len,
                                    vocab_size=config.vocab_size, seed=0)
    params = SamplingParams(max_tokens=args.max_tokens)
    results, ttfts = {}, {}
    threads = torch.get_num_threads()
    if args.device == "cpu":
        torch.set_num_threads(1)  # (as the bench: one thread, so CPU time is the work done)
    try:
        for caching in (True, False):
            engine = build_engine(config, num_blocks=args.num_blocks, enable_caching=caching,
                                  enable_events=True, device=args.device)
            marks = [time.process_time()]  # before the first step, then after each step
            chat = run_chat(engine, convs, params, system_prompt=system,
                            on_step=lambda rec, marks=marks: marks.append(time.process_time()))
            results[caching] = chat
            ttfts[caching] = turn_ttfts(chat.turns, marks)
    finally:
        torch.set_num_threads(threads)

    on, off = results[True], results[False]
    print(f"{args.conversations} conversations x {args.turns} turns, system prompt "
          f"{args.system_len} tokens, {args.max_tokens} tokens per reply, device {args.device}")
    for c, replies in enumerate(on.replies):
        print(f"  conversation {c} last reply: {list(replies[-1])}")
    print(f"{'turn':>4} {'cache':>5} {'prefill tok':>11} {'hit rate':>8} {'TTFT ms (process CPU)':>21}")
    for t in range(args.turns):
        for caching, chat in ((True, on), (False, off)):
            turn = chat.turns[t]
            print(f"{t:>4} {'on' if caching else 'off':>5} {turn.num_prefill_tokens:>11} "
                  f"{turn.stats.hit_rate:>8.1%} {ttfts[caching][t] * 1e3:>21.2f}")
    same = on.replies == off.replies
    print(f"prefill tokens: {on.num_prefill_tokens} with caching, {off.num_prefill_tokens} without; "
          f"replies identical: {same}")
    if not same:
        raise SystemExit("replies differ between caching on and off")


if __name__ == "__main__":
    main()
