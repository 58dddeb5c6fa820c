import sys, httpx
sys.path.insert(0, "bench")
from local_server import start_local_server
from speculative import TASKS
proc, url = start_local_server("--model", "smollm2-135m", "--speculative", "ngram")
try:
    print(httpx.get(url + "/health").json())
    r = httpx.post(url + "/v1/chat/completions", json={"model": "smollm2-135m", "messages": [{"role": "user", "content": TASKS["copy"]}], "max_tokens": 24, "temperature": 0, "ignore_eos": True}, timeout=300)
    print(r.json()["choices"][0]["message"]["content"][:100])
    print(httpx.get(url + "/health").json())
finally:
    proc.terminate(); proc.wait()
