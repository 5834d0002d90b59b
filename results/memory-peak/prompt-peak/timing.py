"""Prompt step time and bits, old vs new flow, side by side in one process (SmolLM2 bf16)."""
import sys, time, types, subprocess, statistics
sys.path.insert(0, "/work/wt-peak/scripts")
import torch, benchlib, gear_hf
import gear_hf.cache.layer as layer_mod, gear_hf.cache.stream as stream_mod
from gear_hf.cache.gear_cache import GearCache
torch.set_grad_enabled(False)
T, reps = int(sys.argv[1]), int(sys.argv[2])
old_src = subprocess.run(["git", "-C", "/work/wt-peak", "show", "642058e:gear_hf/compress/allocation.py"], capture_output=True, text=True, check=True).stdout
old = types.ModuleType("gear_hf.compress._old_allocation"); old.__package__ = "gear_hf.compress"
exec(compile(old_src, "old_allocation.py", "exec"), old.__dict__)
import gear_hf.compress.allocation as new
new_drop = GearCache._drops_workspace_per_layer
def use(which):
    src = old if which == "old" else new
    layer_mod.query_pair_energy = src.query_pair_energy
    stream_mod.allocate_channel_bits = src.allocate_channel_bits
    GearCache._drops_workspace_per_layer = (lambda self: False) if which == "old" else new_drop
model, tok = benchlib.load_model("smollm2", "bfloat16")
ids = benchlib.fixed_length_batch(tok, [p.prompt for p in benchlib.gsm8k_prompts(1)], T, 1)
def state(cache):
    out = {}
    for i, layer in enumerate(cache.layers):
        for s, st in enumerate(layer.streams):
            for part in ("prefill", "decode"):
                store = getattr(st, part)
                if store is not None:
                    out.update({f"{i}/{s}/{part}/{f}": t.clone() for f, t in store.fields.items()})
            out.update({f"{i}/{s}/buffer/{k}": v.clone() for k, v in vars(st.buffer).items() if isinstance(v, torch.Tensor)})
            if st.channel_bits is not None:
                out[f"{i}/{s}/bits"] = st.channel_bits.clone()
    return out
for name, cfg in [("GearConfig()", gear_hf.GearConfig()), ("int8 tail", gear_hf.GearConfig(key_buffer="int8", value_buffer="int8"))]:
    gear_hf.enable(model, cfg)
    times = {"old": [], "new": []}; states = {}
    for which in ("old", "new"):  # identity: 8 decode steps, scores and stores
        use(which)
        o = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                           pad_token_id=tok.pad_token_id, output_scores=True, return_dict_in_generate=True)
        states[which] = {**state(gear_hf.last_cache(model)), "scores": torch.stack(o.scores), "ids": o.sequences}
    a, b = states["old"], states["new"]
    same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    print(f"{name}: {len(a)} tensors (stores, channel widths, 8 steps' scores, ids) old vs new identical: {same}", flush=True)
    for r in range(reps):
        for which in (("old", "new") if r % 2 == 0 else ("new", "old")):
            use(which)
            t0 = time.perf_counter()
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=tok.pad_token_id)
            times[which].append(time.perf_counter() - t0)
    ratios = [n / o for n, o in zip(times["new"], times["old"])]
    print(f"{name} T={T}: prompt step old {[round(t, 2) for t in times['old']]} s, new {[round(t, 2) for t in times['new']]} s; "
          f"new/old per pair {[round(x, 3) for x in ratios]}, median {statistics.median(ratios):.3f}", flush=True)
    gear_hf.disable(model)
