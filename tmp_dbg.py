import asyncio, sys, time, torch
sys.path.insert(0, "bench")
from speculative import TASKS
from engine import load_runner
from server.generation import Generation, ChoiceDelta
from server.sampling import SamplingParams
from server.scheduler import Scheduler
from server.speculation import Speculator, SpeculativeConfig
r = load_runner("smollm2-135m")
ids = r.tokenizer.apply_chat_template([{"role": "user", "content": TASKS["copy"]}], add_generation_prompt=True)
print(len(ids))
async def main(spec):
    s = Scheduler(r, speculator=spec)
    g = Generation(prompt_ids=ids, params=SamplingParams(temperature=0), max_tokens=48, ignore_eos=True)
    s.add(g); t=time.perf_counter(); steps=0
    while s.has_work(): s.step(); steps+=1
    await asyncio.sleep(0)
    toks=[]
    while not g.channel.empty():
        _, e = g.channel.get_nowait()
        if isinstance(e, ChoiceDelta): toks += e.tokens
    return toks, steps, time.perf_counter()-t
a = asyncio.run(main(None))
spec = Speculator(SpeculativeConfig("ngram", 4))
b = asyncio.run(main(spec))
print(a[0]==b[0], a[1:], b[1:], spec.stats)
print(repr(r.tokenizer.decode(b[0])))
