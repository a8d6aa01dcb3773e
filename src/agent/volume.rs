//! Locating a pod volume under the kubelet pods directory (being written).
