import torch, time
from tensorrt_llm._torch.pyexecutor.sampler import SamplingTensors, sample, filtered_probs, draw, uniform
from tensorrt_llm._torch.pyexecutor.launched_step import DeviceTokens
def t(f, n=20):
    f(); torch.cuda.synchronize(); s=time.perf_counter()
    for _ in range(n): f()
    torch.cuda.synchronize(); return (time.perf_counter()-s)/n*1e3
for B in (1,16,64):
    V=200064
    logits=torch.randn(B,V,device='cuda',dtype=torch.bfloat16)*3
    st=SamplingTensors(torch.full((B,),0.8,device='cuda'),torch.zeros(B,dtype=torch.long,device='cuda'),torch.full((B,),0.9,device='cuda'),torch.arange(B,device='cuda'),torch.zeros(B,dtype=torch.long,device='cuda'),False)
    scaled=logits.float()
    r={}
    r['argmax']=t(lambda: logits.argmax(-1))
    r['sample']=t(lambda: sample(logits,st))
    r['filtered']=t(lambda: filtered_probs(logits,st))
    r['sort']=t(lambda: scaled.sort(dim=-1,descending=True))
    r['topk1024']=t(lambda: scaled.topk(1024,dim=-1))
    p=torch.softmax(scaled,-1)
    r['draw']=t(lambda: draw(p, uniform(st.seed, st.counter, 0)))
    dt=DeviceTokens(list(range(B)), logits.argmax(-1)[:,None])
    r['logprobs']=t(lambda: dt.with_logprobs(logits,2))
    print(B, {k: round(v,3) for k,v in r.items()})
