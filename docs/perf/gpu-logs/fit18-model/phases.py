# fit18: warp instructions per tile by phase of the (1, 10) 4-warp kernel, from ncu's per-SASS-instruction
# counts (fit18-run1, SourceCounters, expert 0 = 57,344 tiles) and the line-info chains of the same
# kernel built locally (nvdisasm -gi; nvcc 13.0.88, same 8,912 instructions, every opcode equal).
import re,csv,gzip,io,collections,sys
sass, csvgz, tiles = sys.argv[1], sys.argv[2], 57344
ins=[]; cur=[]; pending=False
for l in open(sass):
    m=re.match(r'\s*//## File "([^"]+)", line (\d+)(.*)',l)
    if m:
        if not pending: cur=[]
        pending=True
        cur.append((m.group(1).split('/')[-1],int(m.group(2))))
        cur+= [(f.split('/')[-1],int(n)) for f,n in re.findall(r'inlined at "([^"]+)", line (\d+)',m.group(3))]
        continue
    m=re.match(r'\s*/\*([0-9a-f]{4,5})\*/\s+(.*?);',l)
    if m:
        ins.append((m.group(2).strip(),list(cur))); pending=False
lines=gzip.open(csvgz,'rt').read().splitlines()
rows=list(csv.reader(io.StringIO('\n'.join(lines[1:]))))
hdr=rows[0]; rows=[r for r in rows[1:] if len(r)==len(hdr)]
H={h:i for i,h in enumerate(hdr)}
I=H['Instructions Executed']; T=H['Thread Instructions Executed']; S=H['Source']
assert len(ins)==len(rows) and all(a.split()[0]==r[S].strip().split()[0].rstrip(';') for (a,_),r in zip(ins,rows))
F='fit_binned_dp_warp.cu'
def phase(ch):
    sites=set(n for f,n in ch if f==F)
    if 1948 in sites:
        if sites & set(range(1039,1080)) or 1141 in sites: return '1 load'
        if sites & set(range(1080,1136)) or 1143 in sites: return '2 check'
        if sites & set(range(1147,1187)): return '3 sort + de-duplication'
        return '4 rest of the front'
    if 1960 in sites: return '5 bin edges'
    if 1962 in sites: return '6 prefix sums at the edges (edge_sums_c)'
    if 1963 in sites:
        if 1714 in sites or sites & set(range(1625,1655)): return '7 DP: run-cost table fill'
        return '8 DP: layers over the table, trace, entries'
    if 1964 in sites: return '9 refinement'
    if 1966 in sites: return '10 encoding + per-tile sums'
    if sites & set(range(1943,1968)): return '0 scale, zero tile'
    return '0 tile loop'
agg=collections.defaultdict(lambda:[0,0,0])
for (a,ch),r in zip(ins,rows):
    p=phase(ch); e=int(r[I]); t=int(r[T]); agg[p][0]+=e; agg[p][1]+=t; agg[p][2]+=1
tot=sum(v[0] for v in agg.values())
print('| phase | SASS instructions | warp instructions / tile | share | active lanes |\n|---|---|---|---|---|')
for p in sorted(agg,key=lambda s:int(s.split()[0])):
    e,t,n=agg[p]
    print(f'| {p} | {n} | {e/tiles:.0f} | {100*e/tot:.1f} % | {t/max(e,1):.1f} |')
print(f'| total | {len(ins)} | {tot/tiles:.0f} | | {sum(v[1] for v in agg.values())/tot:.1f} |')
