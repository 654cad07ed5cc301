/*
 * The C floor of `thiscpu bench`: the loops that thiscpu's fast paths are measured against,
 * written as a C programmer would write them over the same rseq area, and compiled into the
 * command (build.rs) so that every run of the bench can state thiscpu's ratio to them.
 *
 * x86_64 only. Each function takes the offset of the calling thread's registered rseq area
 * from the thread pointer (what `thiscpu::source().area_offset` reports) and returns
 * UINT64_MAX, having done nothing, if that area is not registered in this thread.
 *
 * The area (include/uapi/linux/rseq.h): cpu_id_start at 0, cpu_id at 4, rseq_cs at 8,
 * node_id at 20. A critical section is described by a 32-byte-aligned descriptor (version,
 * flags, start_ip, post_commit_offset, abort_ip); user space arms it by storing the
 * descriptor's address in rseq_cs; if the thread is preempted, migrated or signalled while its
 * instruction pointer lies in [start_ip, start_ip + post_commit_offset), the kernel moves it to
 * abort_ip, which the four bytes before it must vouch for with the registration's signature
 * (0x53053053 on x86_64, glibc's and thiscpu's alike).
 */

#include <stddef.h>
#include <stdint.h>

#define AREA_CPU_ID_START 0
#define AREA_CPU_ID 4
#define AREA_RSEQ_CS 8
#define AREA_NODE_ID 20
#define RSEQ_SIGNATURE 0x53053053

/* Slots of the add loop are this many bytes apart: two cache lines, so that neither a shared
 * line nor the adjacent-line prefetcher ties two CPUs' slots together. */
#define SLOT_SHIFT 7

/* Makes the compiler hold `value` in a register without storing it: the loops' sink. */
#define KEEP(value) __asm__ volatile("" : : "r"(value))

static int32_t cpu_id_of_area(ptrdiff_t offset)
{
	int32_t cpu;
	__asm__ volatile("movl %%fs:%c[field](%[offset]), %[cpu]"
			 : [cpu] "=r"(cpu)
			 : [offset] "r"(offset), [field] "i"(AREA_CPU_ID));
	return cpu;
}

/* `ops` reads of cpu_id, one %fs-relative load each. */
uint64_t thiscpu_c_cpu_id_loop(uint64_t ops, ptrdiff_t offset)
{
	if (cpu_id_of_area(offset) < 0)
		return UINT64_MAX;
	uint32_t cpu = 0;
	for (uint64_t op = 0; op < ops; op++) {
		__asm__ volatile("movl %%fs:%c[field](%[offset]), %[cpu]"
				 : [cpu] "=r"(cpu)
				 : [offset] "r"(offset), [field] "i"(AREA_CPU_ID));
		KEEP(cpu);
	}
	return cpu;
}

/*
 * `ops` reads of the pair (cpu_id, node_id), each inside a restartable sequence so that the
 * pair belongs to one CPU: a migration between the two loads sends the thread to the abort
 * handler, which reads both again. Returns the number of aborts.
 */
uint64_t thiscpu_c_cpu_node_loop(uint64_t ops, ptrdiff_t offset)
{
	if (cpu_id_of_area(offset) < 0)
		return UINT64_MAX;
	uint64_t aborts = 0;
	for (uint64_t op = 0; op < ops; op++) {
		uint64_t scratch;
		uint32_t cpu, node;
		__asm__ volatile(
			".pushsection __thiscpu_c_rseq_cs, \"aw\"\n\t"
			".balign 32\n"
			"30:\n\t"
			".long 0, 0\n\t"
			".quad 31f, 32f - 31f, 33f\n\t"
			".popsection\n"
			"34:\n\t"
			"leaq 30b(%%rip), %[scratch]\n\t"
			"movq %[scratch], %%fs:%c[cs](%[offset])\n"
			"31:\n\t"
			"movl %%fs:%c[cpu_field](%[offset]), %[cpu]\n\t"
			"movl %%fs:%c[node_field](%[offset]), %[node]\n"
			"32:\n\t"
			".pushsection __thiscpu_c_rseq_abort, \"ax\"\n\t"
			/* ud1 with the signature as its displacement: the four bytes before the
			 * handler, and an instruction a disassembler can show. */
			".byte 0x0f, 0xb9, 0x3d\n\t"
			".long %c[signature]\n"
			"33:\n\t"
			"incq %[aborts]\n\t"
			"jmp 34b\n\t"
			".popsection\n"
			: [scratch] "=&r"(scratch), [cpu] "=&r"(cpu), [node] "=&r"(node),
			  [aborts] "+r"(aborts)
			: [offset] "r"(offset), [cs] "i"(AREA_RSEQ_CS),
			  [cpu_field] "i"(AREA_CPU_ID), [node_field] "i"(AREA_NODE_ID),
			  [signature] "i"(RSEQ_SIGNATURE)
			: "cc");
		KEEP(cpu);
		KEEP(node);
	}
	return aborts;
}

/*
 * One increment of this CPU's slot of `slots` (`slot_count` slots, 1 << SLOT_SHIFT bytes
 * apart) as a restartable sequence: read the CPU, arm, check that the thread still runs there,
 * then load, add and store the slot, the store committing. No lock prefix: only threads of
 * that CPU write its slot, and none of them can run inside the section without the others
 * being sent to abort. Counts each abort in `*aborts`, or sets it to UINT64_MAX if the CPU
 * number is out of range (having added nothing).
 */
static inline __attribute__((always_inline)) void add_section(ptrdiff_t offset, uint64_t *slots,
							     uint64_t slot_count,
							     uint64_t *aborts)
{
	uint64_t cpu, value;
	__asm__ volatile(
		".pushsection __thiscpu_c_rseq_cs, \"aw\"\n\t"
		".balign 32\n"
		"40:\n\t"
		".long 0, 0\n\t"
		".quad 41f, 42f - 41f, 43f\n\t"
		".popsection\n"
		"44:\n\t"
		"movl %%fs:%c[start_field](%[offset]), %k[cpu]\n\t"
		"cmpq %[count], %[cpu]\n\t"
		"jae 45f\n\t"
		"leaq 40b(%%rip), %[value]\n\t"
		"movq %[value], %%fs:%c[cs](%[offset])\n"
		"41:\n\t"
		"cmpl %k[cpu], %%fs:%c[cpu_field](%[offset])\n\t"
		"jne 43f\n\t"
		"shlq %[shift], %[cpu]\n\t"
		"addq %[slots], %[cpu]\n\t"
		"movq (%[cpu]), %[value]\n\t"
		"addq $1, %[value]\n\t"
		"movq %[value], (%[cpu])\n"
		"42:\n\t"
		".pushsection __thiscpu_c_rseq_abort, \"ax\"\n\t"
		".byte 0x0f, 0xb9, 0x3d\n\t"
		".long %c[signature]\n"
		"43:\n\t"
		"incq %[aborts]\n\t"
		"jmp 44b\n"
		"45:\n\t"
		"movq $-1, %[aborts]\n\t"
		"jmp 42b\n\t"
		".popsection\n"
		: [cpu] "=&r"(cpu), [value] "=&r"(value), [aborts] "+r"(*aborts)
		: [offset] "r"(offset), [slots] "r"(slots), [count] "r"(slot_count),
		  [shift] "i"(SLOT_SHIFT), [start_field] "i"(AREA_CPU_ID_START),
		  [cs] "i"(AREA_RSEQ_CS), [cpu_field] "i"(AREA_CPU_ID),
		  [signature] "i"(RSEQ_SIGNATURE)
		: "memory", "cc");
}

/*
 * `ops` increments by `add_section`, the offset, slots and count held in registers across the
 * loop. Returns the number of aborts, or UINT64_MAX if a CPU number is out of range (having
 * stopped there).
 */
uint64_t thiscpu_c_add_loop(uint64_t ops, ptrdiff_t offset, uint64_t *slots, uint64_t slot_count)
{
	if (cpu_id_of_area(offset) < 0)
		return UINT64_MAX;
	uint64_t aborts = 0;
	for (uint64_t op = 0; op < ops; op++) {
		add_section(offset, slots, slot_count, &aborts);
		if (aborts == UINT64_MAX)
			return UINT64_MAX;
	}
	return aborts;
}

/* What a C counter type would hold: where the thread's area is, its slots and how many. */
struct thiscpu_c_counter {
	ptrdiff_t offset;
	uint64_t *slots;
	uint64_t slot_count;
};

/*
 * `ops` increments by `add_section` through a `struct thiscpu_c_counter *`, as a C
 * `counter_inc(&counter)` inlined into a loop makes them: the section's "memory" clobber tells
 * the compiler that any memory may have changed, so the three fields are loaded again before
 * every increment. A Rust `Counter::inc(&self)` pays the same three loads for the same reason.
 * Returns as `thiscpu_c_add_loop`.
 */
uint64_t thiscpu_c_add_loop_reloaded(uint64_t ops, const struct thiscpu_c_counter *counter)
{
	if (cpu_id_of_area(counter->offset) < 0)
		return UINT64_MAX;
	uint64_t aborts = 0;
	for (uint64_t op = 0; op < ops; op++) {
		add_section(counter->offset, counter->slots, counter->slot_count, &aborts);
		if (aborts == UINT64_MAX)
			return UINT64_MAX;
	}
	return aborts;
}
