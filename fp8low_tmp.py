import jax, jax.numpy as jnp, time, sys
from tests.cuda_lowering import S, lower_cuda
from pallas_kernels.fused_linear import LinearConfig, Proj
from pallas_kernels.fused_linear_fp8 import norm_linear_fp8, linear_residual_fp8
BF,F32,F8=jnp.bfloat16,jnp.float32,jnp.float8_e4m3fn
sc=lambda n,k: S((-(-n//128), -(-k//128)), F32)
t=int(sys.argv[1])
import os; cfg=LinearConfig(ctas_per_sm=int(os.environ.get("C","1")))
def f(x,nw,w,s,b,bs):
    return norm_linear_fp8(x,nw,((w,s),(b,bs)),projs=(Proj(),Proj()),eps=1e-6,config=cfg, scale_on=os.environ.get("SO","partial"))
t0=time.time()
txt=lower_cuda(f,S((t,2560),BF),S((2560,),BF),S((20480,2560),F8),sc(20480,2560),S((32,2560),F8),sc(32,2560))
print("kda ok", time.time()-t0, txt.count("custom_call @mosaic_gpu"))
def g(x,nw,w1,s1,w2,s2):
    return norm_linear_fp8(x,nw,(((w1,s1),(w2,s2)),),projs=(Proj("swiglu",limit=7.0),),eps=1e-6,config=cfg, scale_on=os.environ.get("SO","partial"))
txt=lower_cuda(g,S((t,2560),BF),S((2560,),BF),S((6144,2560),F8),sc(6144,2560),S((6144,2560),F8),sc(6144,2560))
print("dense ok")
txt=lower_cuda(lambda o,w,s,r: linear_residual_fp8(o,(w,s),r,config=cfg, scale_on=os.environ.get("SO","partial")),S((t,4096),BF),S((2560,4096),F8),sc(2560,4096),S((t,2560),BF))
print("oproj ok")
