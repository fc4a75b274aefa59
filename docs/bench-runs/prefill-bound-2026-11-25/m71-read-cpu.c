// CPU time of O_DIRECT reads of 3 GB into huge pages (1) or 4 KiB pages (0): m71-read-cpu FILE HUGE CHUNK
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static double cpu(){FILE*f=fopen("/proc/stat","r");long long a[10];fscanf(f,"cpu %lld %lld %lld %lld %lld %lld %lld %lld",a,a+1,a+2,a+3,a+4,a+5,a+6,a+7);fclose(f);return (a[0]+a[1]+a[2]+a[5]+a[6])/100.0;}
int main(int c,char**v){int huge=atoi(v[2]);size_t chunk=atol(v[3]);size_t arena=1ul<<30;
 char*b=mmap(0,arena+(2<<20),PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0);
 b=(char*)(((unsigned long)b+(2<<20)-1)&~((2ul<<20)-1));
 madvise(b,arena,huge?MADV_HUGEPAGE:MADV_NOHUGEPAGE);memset(b,1,arena);
 int fd=open(v[1],O_RDONLY|O_DIRECT);size_t tot=3ul<<30;double c0=cpu(),t0=now();
 for(size_t off=0;off<tot;off+=chunk){size_t d=(off/chunk*chunk*7)%(arena-chunk);d&=~4095ul;if(pread(fd,b+d,chunk,off)!=chunk){perror("r");return 1;}}
 printf("huge=%d chunk=%zu wall=%.2f cpu=%.2f\n",huge,chunk,now()-t0,cpu()-c0);}
