//! What the deployment files say, read for the tests that hold them to the code.

/// The `command:` arrays of the compose services that run `image` (built here: `build:` with
/// `image: {image}`), by service, in the file's order.
pub fn compose_commands(compose: &str, image: &str) -> Vec<(String, Vec<String>)> {
    let mut out = Vec::new();
    let (mut service, mut is_kvindex, mut command) = (String::new(), false, None::<Vec<String>>);
    let mut flush = |service: &str, is_kvindex: bool, command: &mut Option<Vec<String>>| {
        if let Some(c) = command.take() {
            if is_kvindex {
                out.push((service.to_string(), c));
            }
        }
    };
    let mut in_services = false;
    for line in compose.lines() {
        if !line.starts_with(' ') && !line.trim().is_empty() && !line.starts_with('#') {
            flush(&service, is_kvindex, &mut command);
            in_services = line.starts_with("services:");
            continue;
        }
        if !in_services {
            continue;
        }
        if let Some(name) = line.strip_prefix("  ").filter(|l| !l.starts_with(' ') && !l.starts_with('#')) {
            flush(&service, is_kvindex, &mut command);
            service = name.trim_end_matches(':').to_string();
            is_kvindex = false;
            continue;
        }
        let l = line.trim();
        if l.strip_prefix("image: ") == Some(image) {
            is_kvindex = true;
        }
        if let Some(c) = l.strip_prefix("command:") {
            command =
                Some(serde_json::from_str(c.trim()).unwrap_or_else(|e| panic!("{service}: command is not a flow list: {e}")));
        }
    }
    flush(&service, is_kvindex, &mut command);
    out
}
