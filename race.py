from h import *
P=43520; J={"Content-Type":"application/json","Accept":"application/json"}
res=[]
for i in range(60):
    d=0.990+ (i%30)*0.0008
    time.sleep(d)
    k=str(uuid.uuid4())
    r=req(P,"POST","/api/orders",json.dumps({"item":"x","qty":2}).encode(),{**J,"Idempotency-Key":k})
    res.append((round(d,4), r[0]))
    if r[0]!=201: print("NON201", d, r[0], r[2][:200], flush=True)
from collections import Counter; print(Counter(s for _,s in res))
