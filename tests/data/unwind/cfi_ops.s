# Every call frame instruction gcc or gas can emit, one per instruction boundary, so that
# readelf --debug-dump=frames-interp prints one row for each (the oracle of test_unwind_readelf).
        .text
        .globl  ops_all
        .type   ops_all, @function
ops_all:
        .cfi_startproc
        push    %rbp
        .cfi_adjust_cfa_offset 8
        .cfi_rel_offset %rbp, 0
        mov     %rsp, %rbp
        .cfi_def_cfa_register %rbp
        push    %rbx
        .cfi_offset %rbx, -24
        push    %r12
        .cfi_val_offset %r12, -32
        .cfi_register %r13, %r14
        .cfi_undefined %r15
        nop
        .cfi_same_value %rbx
        .cfi_remember_state
        nop
        .cfi_def_cfa %rsp, 16
        .cfi_restore %rbx
        .cfi_restore %rbp
        nop
        .cfi_restore_state
        nop
        .cfi_escape 0x2e, 0x10                  # DW_CFA_GNU_args_size 16
        nop
        .cfi_escape 0x10, 0x03, 0x02, 0x76, 0x08   # DW_CFA_expression rbx: breg6 +8
        nop
        .cfi_escape 0x16, 0x0c, 0x02, 0x76, 0x10   # DW_CFA_val_expression r12: breg6 +16
        nop
        .cfi_escape 0x0f, 0x03, 0x76, 0x10, 0x06   # DW_CFA_def_cfa_expression: breg6 +16; deref
        nop
        .cfi_def_cfa %rsp, 8
        nop
        .cfi_escape 0x12, 0x07, 0x7e            # DW_CFA_def_cfa_sf rsp, -2 (x -8 = 16)
        nop
        .cfi_escape 0x13, 0x7d                  # DW_CFA_def_cfa_offset_sf -3 (x -8 = 24)
        nop
        .cfi_escape 0x11, 0x03, 0x7c            # DW_CFA_offset_extended_sf rbx, -4 (x -8 = +32)
        nop
        .cfi_escape 0x15, 0x03, 0x02            # DW_CFA_val_offset_sf rbx, 2
        nop
        .cfi_escape 0x05, 0x11, 0x02            # DW_CFA_offset_extended xmm0, 2
        nop
        .cfi_escape 0x06, 0x11                  # DW_CFA_restore_extended xmm0
        .cfi_escape 0x00                        # DW_CFA_nop
        nop
        .cfi_escape 0x02, 0x04                  # DW_CFA_advance_loc1 4
        .cfi_def_cfa_offset 32
        nop
        .cfi_escape 0x03, 0x02, 0x00            # DW_CFA_advance_loc2 2
        .cfi_def_cfa_offset 40
        nop
        .cfi_escape 0x04, 0x01, 0x00, 0x00, 0x00   # DW_CFA_advance_loc4 1
        .cfi_def_cfa_offset 48
        .fill   300, 1, 0x90
        .cfi_def_cfa_offset 8
        ret
        .cfi_endproc
        .size   ops_all, .-ops_all

        .globl  trap_entry
        .type   trap_entry, @function
trap_entry:
        .cfi_startproc simple
        .cfi_signal_frame
        .cfi_def_cfa %rsp, 40
        .cfi_offset %rip, -40
        .cfi_offset %rsp, -16
        nop
        push    %rax
        .cfi_adjust_cfa_offset 8
        .cfi_offset %rax, -48
        pop     %rax
        .cfi_adjust_cfa_offset -8
        .cfi_restore %rax
        iretq
        .cfi_endproc
        .size   trap_entry, .-trap_entry

        .globl  plt_like
        .type   plt_like, @function
plt_like:
        .cfi_startproc
        .cfi_def_cfa_offset 16
        .cfi_escape 0x0f, 0x0b, 0x77, 0x08, 0x80, 0x00, 0x3f, 0x1a, 0x3b, 0x2a, 0x33, 0x24, 0x22
        pushq   $0
        jmp     *0(%rip)
        .cfi_endproc
        .size   plt_like, .-plt_like
