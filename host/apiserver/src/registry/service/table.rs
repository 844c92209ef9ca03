//! A Service's row as kubectl prints it (`printService`): TYPE, CLUSTER-IP,
//! EXTERNAL-IP, PORT(S) and, wide, SELECTOR.

use serde_json::{Value, json};

use crate::object::Object;

const NONE: &str = "<none>";

/// TYPE, CLUSTER-IP, EXTERNAL-IP, PORT(S), SELECTOR.
pub fn cells(obj: &Object) -> [Value; 5] {
    let spec = obj.get("spec");
    let field = |f: &str| spec.and_then(|s| s.get(f));
    let text = |f: &str| field(f).and_then(Value::as_str).unwrap_or("");
    let ty = text("type");
    let cluster_ip = field("clusterIPs")
        .and_then(Value::as_array)
        .and_then(|a| a.first())
        .and_then(Value::as_str)
        .unwrap_or(NONE);
    let strings = |v: Option<&Value>| -> Vec<String> {
        v.and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .map(str::to_owned)
            .collect()
    };
    let external_ips = strings(field("externalIPs"));
    let external = match ty {
        "ClusterIP" | "NodePort" if !external_ips.is_empty() => external_ips.join(","),
        "ClusterIP" | "NodePort" => NONE.to_owned(),
        "LoadBalancer" => {
            let mut all: Vec<String> = obj
                .get("status")
                .and_then(|s| s.get("loadBalancer"))
                .and_then(|l| l.get("ingress"))
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(|i| {
                    i.get("ip")
                        .or_else(|| i.get("hostname"))
                        .and_then(Value::as_str)
                })
                .map(str::to_owned)
                .collect();
            all.extend(external_ips);
            if all.is_empty() {
                "<pending>".to_owned()
            } else {
                all.join(",")
            }
        }
        "ExternalName" => text("externalName").to_owned(),
        _ => "<unknown>".to_owned(),
    };
    let ports: Vec<String> = field("ports")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|p| {
            let port = p.get("port").and_then(Value::as_i64).unwrap_or(0);
            let protocol = p.get("protocol").and_then(Value::as_str).unwrap_or("TCP");
            match p.get("nodePort").and_then(Value::as_i64).filter(|n| *n > 0) {
                Some(node_port) => format!("{port}:{node_port}/{protocol}"),
                None => format!("{port}/{protocol}"),
            }
        })
        .collect();
    let ports = if ports.is_empty() {
        NONE.to_owned()
    } else {
        ports.join(",")
    };
    // labels.FormatLabels: `k=v` sorted by key.
    let selector = field("selector")
        .and_then(Value::as_object)
        .filter(|s| !s.is_empty())
        .map_or_else(
            || NONE.to_owned(),
            |s| {
                let mut pairs: Vec<String> = s
                    .iter()
                    .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or("")))
                    .collect();
                pairs.sort();
                pairs.join(",")
            },
        );
    [
        json!(ty),
        json!(cluster_ip),
        json!(external),
        json!(ports),
        json!(selector),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cells_of(v: Value) -> Vec<Value> {
        let Value::Object(o) = v else { unreachable!() };
        cells(&o).to_vec()
    }

    #[test]
    fn rows_read_as_kubectl_prints_them() {
        assert_eq!(
            cells_of(
                json!({"spec": {"type": "NodePort", "clusterIPs": ["10.43.1.2"],
                "ports": [{"port": 80, "nodePort": 30080, "protocol": "TCP"},
                          {"port": 53, "protocol": "UDP"}],
                "selector": {"b": "2", "a": "1"}}})
            ),
            [
                json!("NodePort"),
                json!("10.43.1.2"),
                json!("<none>"),
                json!("80:30080/TCP,53/UDP"),
                json!("a=1,b=2")
            ]
        );
        assert_eq!(
            cells_of(json!({"spec": {"type": "ExternalName", "externalName": "example.com"}})),
            [
                json!("ExternalName"),
                json!("<none>"),
                json!("example.com"),
                json!("<none>"),
                json!("<none>")
            ]
        );
        assert_eq!(
            cells_of(
                json!({"spec": {"type": "LoadBalancer", "clusterIPs": ["10.43.1.3"],
                "ports": [{"port": 443, "nodePort": 31000, "protocol": "TCP"}]}})
            )[2],
            json!("<pending>")
        );
    }
}
