#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
// paced O_DIRECT reader: file huge(0/1) chunk rateMBps seconds
int main(int c,char**v){int huge=atoi(v[2]);size_t chunk=atol(v[3]);double rate=atof(v[4])*1e6,dur=atof(v[5]);size_t arena=256ul<<20;
 char*b=mmap(0,arena+(2<<20),PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0);
 b=(char*)(((unsigned long)b+(2<<20)-1)&~((2ul<<20)-1));
 madvise(b,arena,huge?MADV_HUGEPAGE:MADV_NOHUGEPAGE);memset(b,1,arena);
 int fd=open(v[1],O_RDONLY|O_DIRECT);off_t sz=lseek(fd,0,SEEK_END);double t0=now();size_t n=0,off=0;
 while(now()-t0<dur){size_t d=(n*chunk)%(arena-chunk);d&=~4095ul;if(off+chunk>sz)off=0;if(pread(fd,b+d,chunk,off)!=chunk){perror("r");return 1;}off+=chunk;n++;
  double due=t0+n*chunk/rate;double w=due-now();if(w>0)usleep(w*1e6);}
 printf("read %.2f GB in %.1f s\n",n*chunk/1e9,now()-t0);}
