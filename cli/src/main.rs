fn main() {
    let s = thiscpu::source();
    println!("{s:?}");
    println!(
        "cpu {} getcpu {:?} node {} mm_cid {:?}",
        thiscpu::current_cpu(),
        thiscpu::getcpu(),
        thiscpu::current_node(),
        thiscpu::mm_cid()
    );
    std::thread::spawn(|| {
        println!(
            "thread: cpu {} {:?} {:?}",
            thiscpu::current_cpu(),
            thiscpu::getcpu(),
            thiscpu::source().this_thread
        )
    })
    .join()
    .unwrap();
}
